"""A run whose learner has several data-parallel ranks: the flow starts them through DeepSpeed's launcher.

`loopline train` (or the learner deployment on a work pool) with `learner.launch` in the run config runs

    deepspeed [--hostfile H] --num_nodes N --num_gpus G --master_port P --no_local_rank \\
        --module loopline.orchestration.learner_rank --config RUN.yaml ...

and waits (each rank runs `learner_rank`, which imports the train flow; this module is what the flow imports). Rank 0 runs the train flow as it would run alone (ledger, engine, commits); the other ranks
follow its learner (`trainer/ranks.py`). Nothing outlives the flow: the launcher runs in a session of its
own that the flow kills when it ends or is cancelled, and each rank on this host watches the flow's
process and takes the session down if it died (even by SIGKILL); on other hosts, DeepSpeed's launcher
kills the ranks when one of them fails, and rank 0's death breaks the others' collectives.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from loopline import holder
from loopline.errors import LooplineError
from loopline.config import RankLaunch
from loopline.store import db as store_db
from loopline.ports import free_port

# what rank 0 on another host needs to reach the ledger, the Prefect API and the run's files
_FORWARDED = ("LOOPLINE_", "PREFECT_API_", "DS_ACCELERATOR", "E2B_API_KEY")
LAUNCHED = "LOOPLINE_LEARNER_RANK_OF"  # set in the ranks' environment: the flow process that launched them


def launched() -> bool:
    """Whether this process is one of a launched learner's ranks (then it must not launch again)."""
    return LAUNCHED in os.environ


def command(settings: RankLaunch, args: list[str], port: int) -> list[str]:
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).with_name("deepspeed"))
    hosts = ["--hostfile", settings.hostfile] if settings.hostfile else []
    return [
        launcher, *hosts, "--num_nodes", str(settings.nodes), "--num_gpus", str(settings.ranks_per_node),
        "--master_port", str(port), *settings.args, "--no_local_rank", "--module", "loopline.orchestration.learner_rank", *args,
    ]


def run(settings: RankLaunch, config_path: str | None, resume: str | None, fork: str | None) -> dict:
    """Launch the ranks, wait for them, and return rank 0's train flow result."""
    scratch_root = store_db.loopline_home() / "tmp"  # rank 0 writes its result here: on several hosts, a shared home
    scratch_root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="learner-launch-", dir=scratch_root))
    result = scratch / "result.json"
    args = ["--result", str(result), "--parent", holder.this_process()]
    if config_path is not None:
        args += ["--config", str(Path(config_path).resolve())]
    args += ["--resume", resume] if resume else []
    args += ["--fork", fork] if fork else []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.setdefault("DS_ACCELERATOR", _accelerator())
    if settings.nodes > 1:  # DeepSpeed exports the variables of this file to the other hosts (its .deepspeed_env)
        forwarded = scratch / "deepspeed_env"
        forwarded.write_text("".join(f"{k}={v}\n" for k, v in env.items() if k.startswith(_FORWARDED)))
        env["DS_ENV_FILE"] = str(forwarded)
    cmd = command(settings, args, settings.master_port or free_port())
    launcher = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=holder.die_with_parent())
    try:
        code = launcher.wait()
    finally:
        _stop(launcher)
    try:
        outcome = json.loads(result.read_text()) if result.is_file() else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if outcome is None:
        shared = (f"; on {settings.nodes} hosts, each needs LOOPLINE_HOME ({store_db.loopline_home()}) on a filesystem they all mount at "
                  "the same path" if settings.nodes > 1 else "")
        raise LooplineError(f"the learner's ranks exited with status {code} before rank 0 reported (their output is in the run's train.log, or above with -v){shared}")
    if "error" in outcome:
        raise LooplineError(f"rank 0 of the learner failed: {outcome['error']}")
    return outcome["summary"]


def unshared_home(missing: list[tuple[int, str]], scratch: Path) -> str:
    """Why a launched learner refused to start: some ranks' hosts do not see the launching host's LOOPLINE_HOME."""
    who = ", ".join(f"rank {rank} on {host}" for rank, host in missing)
    return (
        f"learner.launch: {who} cannot see {scratch}, which the launching host wrote under its LOOPLINE_HOME: learner ranks on "
        "several hosts share checkpoints and results there, so put LOOPLINE_HOME on a filesystem every learner host mounts at the "
        "same path (and set it there), then start the run again"
    )


def _accelerator() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _stop(launcher: subprocess.Popen) -> None:
    """Take down the launcher's whole session on this host (launcher, DeepSpeed's launch, the ranks)."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(launcher.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(launcher.pid):
            launcher.poll()
            time.sleep(0.1)
        if not _group_alive(launcher.pid):
            return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def watch(parent: str) -> None:
    """On the launching host: when the flow process that launched this learner is gone, so is its session."""

    def loop() -> None:
        while not holder.is_dead(parent):
            time.sleep(1.0)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=loop, name="launcher-watch", daemon=True).start()
