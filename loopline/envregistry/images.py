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
AGENT_IMAGE = "loopline-agent:bookworm"  # the default tag of `envreg image build --pip ...`
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


def image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0


def add_pip_packages(base: str, tag: str, packages: tuple[str, ...], progress: Callable[[str], None] | None = None) -> str:
    """`base` with Python packages added as a layer (an agent program's libraries, e.g. the openai SDK). The
    host's pip downloads wheels for the image's own Python (no pip, compiler or network needed inside) and the
    files are copied into a container of `base`, committed as `tag`."""
    import io
    import sys
    import tarfile

    import docker
    from docker.errors import DockerException, ImageNotFound

    try:
        client = docker.from_env(timeout=120)
        client.images.get(base)
    except ImageNotFound:
        raise LooplineError(f"base image {base!r} is missing; build it first with `{BUILD_COMMAND}`") from None
    except DockerException as exc:
        raise LooplineError(f"the Docker daemon is not reachable ({exc}); start it (e.g. `dockerd &`)") from None
    version = client.containers.run(base, ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], remove=True)
    version = version.decode().strip()
    site = f"/usr/local/lib/python{version}/dist-packages"  # on Debian's sys.path, empty in a minbase image
    with tempfile.TemporaryDirectory(prefix="loopline-pip-") as tmp:
        if progress:
            progress(f"pip: {' '.join(packages)} for Python {version}")
        _run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", tmp, "--python-version", version, "--only-binary=:all:", *packages],
            "pip install",
        )
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            tar.add(tmp, arcname=site.lstrip("/"), filter=_owned_by_root)
        if progress:
            progress(f"committing {tag}")
        container = client.containers.create(base, ["true"])
        try:
            container.put_archive("/", archive.getvalue())
            container.commit(*tag.rsplit(":", 1) if ":" in tag else (tag, "latest"))
        finally:
            container.remove(force=True)
    return tag


def _owned_by_root(info):
    """root's, readable by every uid (the agent runs as 1000; pip's temporary directory was 0700)."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode |= 0o755 if info.isdir() else 0o644
    return info


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
