"""The Docker backend against the real engine (.ci/run starts dockerd and builds the image)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest

from loopline.envregistry.sandbox.backends import open_sandbox
from loopline.envregistry.sandbox.base import InfraFailure
from loopline.envregistry.sandbox.docker import DockerSandbox, cleanup_orphans, _client
from loopline.envregistry.spec import DockerSettings, Sandbox


def _spec(image: str, **resources) -> Sandbox:
    return DockerSettings(backend="docker", image=image, resources=resources or {})


def _with_box(spec: Sandbox, body):
    async def go():
        box = await DockerSandbox.create(spec)
        try:
            return await body(box)
        finally:
            await box.close()

    return asyncio.run(go())


def test_runs_as_a_uid_of_its_own_with_files_in_a_tmpfs_workdir(docker_image):
    big = "x" * 150_000 + "\nend"

    async def body(box):
        await box.write_file("pkg/big.txt", big)
        who = await box.exec("id -u && pwd && python3 -c 'print(len(open(\"pkg/big.txt\").read()))'", 30)
        root = await box.exec("touch /etc/owned", 10)
        return who, root, await box.read_file("pkg/big.txt")

    from loopline.envregistry.sandbox.docker import AGENT_UIDS

    who, root, back = _with_box(_spec(docker_image), body)
    uid, workdir, size = who.stdout.split()
    assert AGENT_UIDS[0] <= int(uid) < AGENT_UIDS[1] and (workdir, size) == ("/workspace", str(len(big)))
    assert not root.ok and "Read-only file system" in root.stderr
    assert back == big


def test_network_is_off(docker_image):
    probe = "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 5432), timeout=2)\" && echo connected"

    async def body(box):
        return await box.exec(probe + "; cat /sys/class/net/*/operstate 2>/dev/null; ls /sys/class/net", 20)

    result = _with_box(_spec(docker_image), body)
    assert "connected" not in result.stdout
    assert result.stdout.split()[-1] == "lo"  # no interface but loopback


def test_timeout_and_oom_are_classified(docker_image):
    async def body(box):
        slow = await box.exec("sleep 30", 1)
        hog = await box.exec("python3 -c 'x = bytearray(400 * 1024 * 1024); print(len(x))'", 30)
        after = await box.exec("echo alive", 10)
        return slow, hog, after

    slow, hog, after = _with_box(_spec(docker_image, memory_mb=64), body)
    assert slow.timed_out and not slow.oom_killed and slow.seconds < 10
    assert hog.oom_killed and not hog.ok
    assert after.ok and after.stdout.strip() == "alive"


def test_missing_image_is_an_infra_failure_naming_the_build_command(docker_image):
    with pytest.raises(InfraFailure, match="envreg image build"):
        asyncio.run(DockerSandbox.create(_spec("loopline-does-not-exist:1")))


def _hold_a_sandbox(image: str, out) -> None:
    async def go():
        box = await DockerSandbox.create(_spec(image))
        out.put(box.container.id)
        await asyncio.sleep(600)

    asyncio.run(go())


def test_sandboxes_of_a_crashed_process_are_cleaned_up(docker_image):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_hold_a_sandbox, args=(docker_image, out), daemon=True)
    proc.start()
    container_id = out.get(timeout=60)
    proc.kill()
    proc.join(timeout=10)
    client = _client()
    assert client.containers.get(container_id).status == "running"  # left behind by the crash
    assert container_id[:12] in cleanup_orphans()
    assert all(c.id != container_id for c in client.containers.list(all=True))


def test_fork_bomb_is_contained_by_the_pids_limit(docker_image):
    async def body(box):
        bomb = await box.exec("f() { f | f & }; f; sleep 3; echo survived", 8)
        return bomb, await box.exec("echo alive", 10)

    bomb, after = _with_box(_spec(docker_image, pids=32), body)
    assert "Cannot fork" in bomb.stderr  # the pids limit refused the bomb's forks
    assert after.ok and after.stdout.strip() == "alive"


def test_setup_commands_run_once_at_start(docker_image):
    from loopline.envregistry.sandbox.backends import open_sandbox

    spec = DockerSettings(backend="docker", image=docker_image, setup=("echo ready > marker",))

    async def go():
        box = await open_sandbox(spec)
        try:
            return await box.read_file("marker")
        finally:
            await box.close()

    assert asyncio.run(go()) == "ready\n"
    broken = DockerSettings(backend="docker", image=docker_image, setup=("exit 7",))
    with pytest.raises(InfraFailure, match="setup command 'exit 7' failed"):
        asyncio.run(open_sandbox(broken))


def test_commands_see_utf8_text_as_on_the_other_backends(docker_image):
    async def body():
        box = await open_sandbox(DockerSettings(backend="docker", image=docker_image))
        try:
            return await box.exec("printf 'café' | wc -m", 10)
        finally:
            await box.close()

    assert asyncio.run(body()).stdout.strip() == "4"
