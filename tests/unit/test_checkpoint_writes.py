"""Issue 31: a checkpoint or an export that does not fit is one line naming the place and the size, and
leaves nothing half-written behind (a real full disk: tests/integration/test_run_lifecycle.py)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

import pytest
import torch

from loopline.trainer.checkpoint import DiskFull, write_complete


def _leftovers(root):
    return sorted(p.name for p in root.iterdir())


def test_a_write_larger_than_the_free_space_is_refused_before_it_starts(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    called = []
    with pytest.raises(DiskFull) as refused:
        write_complete(tmp_path / "checkpoints" / "step-000003.123", called.append, need_bytes=free + 2**30)
    message = str(refused.value)
    assert f"disk of {tmp_path / 'checkpoints'} for step-000003:" in message
    assert f"it needs about {(free + 2**30) / 2**30:.2f} GiB" in message and "loopline train --resume RUN" in message
    assert "\n" not in message and not called
    assert _leftovers(tmp_path / "checkpoints") == []


def test_a_disk_that_fills_during_the_write_is_one_line_and_the_partial_directory_is_removed(tmp_path):
    def fill(tmp):
        (tmp / "state.pt").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFull, match="no space left on the disk of"):
        write_complete(tmp_path / "weights" / "v000004.123", fill, need_bytes=10)
    assert _leftovers(tmp_path / "weights") == []


def test_other_failures_pass_through_and_leave_nothing_behind(tmp_path):
    def fill(tmp):
        (tmp / "half").write_text("...")
        raise ValueError("a bug in a writer")

    with pytest.raises(ValueError, match="a bug in a writer"):
        write_complete(tmp_path / "weights" / "v000004", fill)
    assert _leftovers(tmp_path / "weights") == []


def test_a_complete_write_replaces_nothing_but_its_own_target(tmp_path):
    write_complete(tmp_path / "weights" / "v000001", lambda tmp: (tmp / "a").write_text("1"), need_bytes=1)
    assert _leftovers(tmp_path / "weights") == ["v000001"]
    assert (tmp_path / "weights" / "v000001" / "a").read_text() == "1"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a 1 MiB tmpfs (needs root)")
def test_torch_save_on_a_really_full_disk_is_one_line(tmp_path):
    """torch.save reports ENOSPC as `RuntimeError: [enforce fail at inline_container.cc] unexpected pos`."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        with pytest.raises(DiskFull, match=f"no space left on the disk of {disk} for step-000001: "):
            write_complete(disk / "step-000001", lambda tmp: torch.save(torch.zeros(2**20), tmp / "state.pt"))
        assert _leftovers(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)
