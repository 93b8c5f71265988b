"""A learner's one-process group is taken down when the process exits.

On an H200 (2026-12-04, torch 2.11, NCCL) `loopline train` finished its run and then never exited while the
NCCL group was left to the interpreter's teardown; destroying it at exit let the same run exit. NCCL needs a
GPU, so this checks the mechanism on gloo: by the time the process's earlier exit hooks run, the group is gone.
"""

import subprocess
import sys
import textwrap


def test_the_process_group_a_learner_formed_is_destroyed_before_the_process_exits():
    program = textwrap.dedent(
        """
        import atexit, torch
        # registered first, so it runs after the hooks init_distributed registers (atexit is last-in first-out)
        atexit.register(lambda: print("initialized at exit:", torch.distributed.is_initialized(), flush=True))
        from loopline.trainer.backends import init_distributed
        init_distributed("gloo")
        print("initialized:", torch.distributed.is_initialized(), flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "initialized: True" in out.stdout
    assert "initialized at exit: False" in out.stdout
