"""Sandbox images built without any image registry: debootstrap a Debian root, then `docker import` it."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from loopline.errors import LooplineError

PYTHON_IMAGE = "loopline-python:bookworm"
BUILD_COMMAND = "envreg image build"


def build_python_image(
    tag: str = PYTHON_IMAGE, suite: str = "bookworm", extra_packages: tuple[str, ...] = (), progress: Callable[[str], None] | None = None
) -> str:
    """A minimal Debian with python3 and a uid-1000 user `sandbox`; returns the image tag. `progress` gets
    each stage as it starts (debootstrap's own "I: ..." lines, then the import)."""
    if os.geteuid() != 0:
        raise LooplineError(f"{BUILD_COMMAND} needs root (debootstrap creates device files and chroots)")
    if shutil.which("debootstrap") is None:
        raise LooplineError("debootstrap is not installed: apt-get install -y debootstrap")
    if shutil.which("docker") is None:
        raise LooplineError("the docker CLI is not installed: apt-get install -y docker.io")
    packages = ",".join(("python3", *extra_packages))
    with tempfile.TemporaryDirectory(prefix="loopline-rootfs-") as tmp:
        root = Path(tmp) / "root"
        _run(["debootstrap", "--variant=minbase", f"--include={packages}", suite, str(root)], "debootstrap", progress=progress)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (root / cache).glob("*"):
                if item.is_file():
                    item.unlink()
        with open(root / "etc/passwd", "a") as f:
            f.write("sandbox:x:1000:1000::/workspace:/bin/sh\n")
        with open(root / "etc/group", "a") as f:
            f.write("sandbox:x:1000:\n")
        (root / "workspace").mkdir(exist_ok=True)
        for path in (root / "workspace", root / "tmp"):
            path.chmod(0o1777)
        if progress:
            progress(f"importing the root filesystem into Docker as {tag}")
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        _run(["docker", "import", "-c", "WORKDIR /workspace", "-", tag], "docker import", stdin=tar.stdout)
        tar.wait()
    return tag


def _run(argv: list[str], what: str, stdin=None, progress: Callable[[str], None] | None = None) -> None:
    """Run a build command; its output lines go to `progress` as they come, its tail into the error."""
    process = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: collections.deque[str] = collections.deque(maxlen=20)
    for line in process.stdout:
        tail.append(line)
        if progress and line.startswith("I: "):
            progress(line[3:].strip())
    if process.wait() != 0:
        raise LooplineError(f"{what} failed ({process.returncode}): {''.join(tail).strip()[-500:]}")
