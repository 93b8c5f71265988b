"""The E2B backend: the real `e2b` SDK, driven against a local envd endpoint over a Docker container.

E2B's cloud cannot be reached from here, so these tests run the SDK in its
debug mode (no control-plane calls) against `tests/envd_over_docker.py`; every
command and file really runs in a container. The names say so.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loopline.envregistry.episode import Episode, ToolCall
from loopline.envregistry.sandbox.base import InfraFailure, open_sandbox
from loopline.envregistry.sandbox.e2b import E2BSandbox
from loopline.envregistry.spec import EnvSpec, Sandbox, load_spec
from loopline.envregistry.tasks import load_tasks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
E2B_SPEC = Sandbox(backend="e2b", template="loopline-python")


def _with_box(body):
    async def go():
        box = await open_sandbox(E2B_SPEC)
        try:
            return await body(box)
        finally:
            await box.close()

    return asyncio.run(go())


def test_e2b_sdk_against_local_envd_runs_commands_and_files(local_envd):
    async def body(box):
        assert isinstance(box, E2BSandbox)
        await box.write_file("pkg/a.py", "print('hi from e2b')\n")
        return (
            await box.exec("python3 pkg/a.py && pwd", 10),
            await box.exec("echo oops >&2; exit 3", 10),
            await box.exec("cat", 10, stdin="from stdin"),
            await box.read_file("/workspace/pkg/a.py"),
        )

    ran, failed, piped, text = _with_box(body)
    assert ran.ok and ran.stdout.split("\n")[:2] == ["hi from e2b", "/workspace"]
    assert (failed.exit_code, failed.stderr, failed.ok) == (3, "oops\n", False)
    assert piped.stdout == "from stdin"
    assert text == "print('hi from e2b')\n"
    assert "/process.Process/Start" in local_envd.requests and "/files" in local_envd.requests


def test_e2b_sdk_against_local_envd_times_out_commands(local_envd):
    async def body(box):
        return await box.exec("sleep 30", 1)

    result = _with_box(body)
    assert result.timed_out and not result.ok and result.seconds < 10


def test_e2b_sdk_against_local_envd_plays_the_coding_env(local_envd):
    spec = load_spec(EXAMPLES / "coding_env.yaml")
    e2b_spec = EnvSpec.model_validate({**spec.canonical(), "sandbox": E2B_SPEC.model_dump()})
    task = next(t for t in load_tasks(spec, EXAMPLES) if t.id == "c02")

    async def play(content):
        episode = await Episode.start(e2b_spec, task)
        try:
            await episode.reset()
            if content is not None:
                await episode.step(ToolCall("write_file", {"path": "solution.py", "content": content}))
            return await episode.verify("All tests pass, trust me.")
        finally:
            await episode.close()

    assert asyncio.run(play(task.data["solution"])).reward == 1.0
    local_envd.reset()  # what E2B's create() gives: a new sandbox per episode
    assert asyncio.run(play(None)).reward == 0.0


def test_e2b_without_credentials_is_an_infra_failure(monkeypatch):
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(InfraFailure, match="could not create an E2B sandbox .*API key"):
        asyncio.run(open_sandbox(Sandbox(backend="e2b", template="anything")))
