"""The E2B backend: the real `e2b` SDK, driven against a local stand-in for E2B's control plane and envd.

E2B's cloud cannot be reached from here, so these tests point the SDK at `tests/fakes/envd_over_docker.py`:
each sandbox is a new Docker container made like an E2B VM from a template built as E2B builds them; every
command and file really runs there. The names say so.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from loopline.envregistry.episode import Episode, ToolCall
from loopline.envregistry.sandbox.backends import open_sandbox
from loopline.envregistry.sandbox.base import InfraFailure
from loopline.envregistry.sandbox.e2b import E2BSandbox
from loopline.envregistry.spec import E2BSettings, EnvSpec, load_spec
from loopline.envregistry.tasks import load_tasks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
E2B_SPEC = E2BSettings(backend="e2b", template="loopline-python")


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
    assert asyncio.run(play(None)).reward == 0.0


def test_e2b_without_credentials_is_an_infra_failure(monkeypatch):
    for name in ("E2B_DEBUG", "E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InfraFailure, match="could not create an E2B sandbox .*API key"):
        asyncio.run(open_sandbox(E2BSettings(backend="e2b", template="anything")))


@pytest.fixture
def public_endpoint(monkeypatch, local_envd, agent_image):
    """This process's agent endpoint listening on Docker's bridge, at the URL given as its public one, and the
    stand-in's sandbox on that bridge with the openai SDK (as an E2B template for agents would have it)."""
    import socket

    from loopline.rollout.harness import agent_program

    gateway = "172.17.0.1"  # the host on Docker's default bridge
    with socket.socket() as probe:
        probe.bind((gateway, 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv(agent_program.LISTEN_VAR, f"{gateway}:{port}")
    monkeypatch.setenv(agent_program.URL_VAR, f"http://{gateway}:{port}")
    monkeypatch.setattr(agent_program, "_endpoint", None)
    from tests.fakes.envd_over_docker import provisioned_image

    local_envd.templates["loopline-agent"] = provisioned_image(agent_image, harden=True)
    yield f"http://{gateway}:{port}"
    if agent_program._endpoint is not None:
        agent_program._endpoint.stop()


PRINTS_ITS_BASE_URL = """
import json, os, sys
from openai import OpenAI
task = json.load(sys.stdin)
said = OpenAI().chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
open("answer.txt", "w").write(os.environ["OPENAI_BASE_URL"] + " " + said.choices[0].message.content)
"""


def test_e2b_sdk_against_local_envd_runs_an_agent_program_that_reaches_the_model_at_its_public_url(public_endpoint, tmp_path, monkeypatch):
    """The program in the (stood-in) E2B sandbox gets OPENAI_BASE_URL under the endpoint's public URL and its calls
    are served there; the cloud's allow list itself is `test_e2b_agent_sandbox_asks_the_cloud_for_only_the_endpoint`."""
    from loopline.rollout.harness.chat import ChatFormat
    from tests.integration.test_agent_program import Scripted, _env, _play
    from tests.integration.test_train_flow import STARTER

    def on_e2b(env_file):
        import yaml

        spec = yaml.safe_load(env_file.read_text()) | {"sandbox": {"backend": "e2b", "template": "loopline-agent"}}
        env_file.write_text(yaml.safe_dump(spec))
        return env_file

    chat = ChatFormat.for_policy(STARTER)
    answers = {}
    original = Episode.verify

    async def keep_answer(self, final):
        answers[self.task.id] = final
        return await original(self, final)

    monkeypatch.setattr(Episode, "verify", keep_answer)
    (probe,) = _play(on_e2b(_env(tmp_path / "probe", PRINTS_ITS_BASE_URL)), Scripted(chat, ["hello"]))
    assert not isinstance(probe, Exception), probe
    url, said = answers[next(iter(answers))].split(" ", 1)
    assert url.startswith(f"{public_endpoint}/episodes/ep-") and url.endswith("/v1") and said == "hello"

    # `envreg test` of the example agent, unchanged: the scripted model calls the calculator, then answers
    from loopline.envregistry.registry import prepare
    from loopline.rollout.harness.agent_program import play_scripted

    prepared = prepare(on_e2b(_env(tmp_path / "example", None)))
    task = next(t for t in prepared.tasks if t.split == "train")
    result = asyncio.run(play_scripted(prepared.spec, task, STARTER))
    assert result.infra_error is None and result.reward == 1.0 and len(result.steps) == 2, result


def test_e2b_sdk_against_local_envd_stops_an_agent_program_at_its_wall_time(public_endpoint, tmp_path):
    """A program past `budgets.wall_time_s` is killed in its (stood-in) E2B sandbox, as E2B's `user`, and the
    episode is truncated, not waited out; a program that crashes after calling the model failed its task."""
    import time

    import yaml

    from loopline.rollout.harness.chat import ChatFormat
    from tests.integration.test_agent_program import CRASH_AFTER_A_CALL, SLOW_PROGRAM, Scripted, _env, _play
    from tests.integration.test_train_flow import STARTER

    def on_e2b(env_file):
        spec = yaml.safe_load(env_file.read_text()) | {"sandbox": {"backend": "e2b", "template": "loopline-agent"}}
        env_file.write_text(yaml.safe_dump(spec))
        return env_file

    chat = ChatFormat.for_policy(STARTER)
    (crashed,) = _play(on_e2b(_env(tmp_path / "a", CRASH_AFTER_A_CALL)), Scripted(chat, ["x"]))
    assert crashed.failure_type == "task_failed" and crashed.info["exit_code"] == 1 and "gave up" in crashed.info["stderr"]
    started = time.monotonic()
    (slow,) = _play(on_e2b(_env(tmp_path / "b", SLOW_PROGRAM, wall_time_s=5)), Scripted(chat, ["x"]))
    assert (slow.failure_type, slow.info["end"]) == ("truncated", "wall_time") and time.monotonic() - started < 25


@pytest.mark.parametrize("case", ["a_link_out_of_the_workdir", "a_directory", "invalid_utf8_around_the_right_answer"])
def test_e2b_sdk_against_local_envd_scores_an_answer_file_the_agent_made_odd(case, public_endpoint, tmp_path):
    """As on local and Docker (`test_agent_program.ANSWER_FILES`): what the program leaves as answer.txt is read
    as the agent's user and scored, never an exception out of the episode."""
    import yaml

    from loopline.envregistry.registry import prepare
    from loopline.rollout.harness.chat import ChatFormat
    from tests.integration.test_agent_program import ANSWER_FILES, ANSWER_PROGRAM, Scripted, _env, _play
    from tests.integration.test_train_flow import STARTER

    leave, earned = ANSWER_FILES[case]
    env_file = _env(tmp_path, ANSWER_PROGRAM.format(leave=leave))
    env_file.write_text(yaml.safe_dump(yaml.safe_load(env_file.read_text()) | {"sandbox": {"backend": "e2b", "template": "loopline-agent"}}))
    task = next(t for t in prepare(env_file).tasks if t.split == "train")
    (played,) = _play(env_file, Scripted(ChatFormat.for_policy(STARTER), [f"<answer>{task.data['answer']}</answer>"]))
    assert not isinstance(played, Exception), played
    assert (played.reward, played.failure_type) == (earned, None if earned else "task_failed"), played.info
