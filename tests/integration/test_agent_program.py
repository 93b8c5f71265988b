"""Envs with `agent:`: the user's own program (the openai SDK, no loopline import) plays episodes in the local
sandbox (bubblewrap: no network but the model endpoint; as root, as an unprivileged uid) or in a Docker container
(network none, the endpoint's socket mounted), its model calls are the trajectory's segments exactly as sampled,
and its failures are classified as the built-in harness's are. Needs bubblewrap and the `openai` package in the
system python3 (.ci/run installs both); the Docker tests build `envreg image build --pip openai` if missing."""

from __future__ import annotations

import asyncio
import functools
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from loopline.envregistry.registry import prepare
from loopline.envregistry.sandbox.base import InfraFailure
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import Generation, SamplingParams, VersionSpan
from loopline.rollout.engines.thread import EngineThread
from loopline.rollout.harness.episode import EpisodeSetup, run_episode
from loopline.rollout.engines.local import LocalEngine
from loopline.types import first_chain_break
from tests.integration.test_train_flow import STARTER

ROOT = Path(__file__).resolve().parents[2]
AGENT_ENV = ROOT / "examples" / "arithmetic_agent_env.yaml"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="agent programs run in bubblewrap (apt-get install -y bubblewrap)")


@pytest.fixture(scope="module", autouse=True)
def _system_python_has_openai():
    probe = subprocess.run(["/usr/bin/python3", "-c", "import openai"], capture_output=True)
    assert probe.returncode == 0, "agent programs need openai in the system python3: /usr/bin/python3 -m pip install --break-system-packages openai"


class Recording:
    """The real engine, with every generation it returned kept (what the trajectory must hold, id for id)."""

    def __init__(self, engine):
        self.engine, self.returned = engine, []

    def version(self) -> int:
        return self.engine.version()

    async def generate(self, prompt_ids, sampling, request_id):
        gen = await self.engine.generate(prompt_ids, sampling, request_id)
        self.returned.append((list(prompt_ids), list(gen.token_ids)))
        return gen


class Scripted:
    """Replies with given texts, after `delay_s` (a slow engine)."""

    def __init__(self, chat: ChatFormat, replies: list[str], delay_s: float = 0.0):
        self.chat, self.replies, self.delay_s = chat, list(replies), delay_s

    def version(self) -> int:
        return 0

    async def generate(self, prompt_ids, sampling, request_id):
        await asyncio.sleep(self.delay_s)
        ids = self.chat.tokenizer.encode(self.replies.pop(0) if self.replies else "<answer>0</answer>", add_special_tokens=False)
        ids.append(self.chat.eos_id)
        return Generation(tuple(ids), tuple([-1.0] * len(ids)), "stop", (VersionSpan(0, 0, len(ids)),))


def _sandbox_processes(tmpdir: Path) -> list[str]:
    """Processes of the local sandboxes made under `tmpdir` (a trainer's TMPDIR): bwrap names its directory in its
    argv, and a program inside has it as HOME (its argv, `python3 agent.py`, names nothing). Other tests' and
    users' sandboxes on this machine are not counted."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            text = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{tmpdir}/loopline-sandbox-" in text or f"HOME={tmpdir}/loopline-sandbox-".encode() in b" ".join(environ):
            found.append(f"{proc.name} {text[:160]}")
    return found


def _docker(env_file: Path, image: str) -> Path:
    spec = yaml.safe_load(env_file.read_text())
    spec["sandbox"] = {"backend": "docker", "image": image}
    env_file.write_text(yaml.safe_dump(spec))
    return env_file


def _env(tmp_path: Path, program: str | None, **budgets) -> Path:
    """The arithmetic agent env with another program (None: the example's) and budgets, in a directory of its own."""
    tmp_path.mkdir(exist_ok=True)
    spec = yaml.safe_load(AGENT_ENV.read_text())
    (tmp_path / "agent.py").write_text(program or (ROOT / "examples" / "arithmetic_agent.py").read_text())
    spec["agent"]["files"] = {"agent.py": "agent.py"}
    spec["budgets"] = {**spec["budgets"], **budgets}
    path = tmp_path / "env.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _play(env_file: Path, engine, count: int = 1, max_new_tokens: int = 64):
    prepared = prepare(env_file)
    setup = EpisodeSetup(prepared.spec, 1, ChatFormat.for_policy(STARTER), SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens))
    tasks = [t for t in prepared.tasks if t.split == "train"][:count]

    async def all_of_them():
        return await asyncio.gather(*(run_episode(engine, setup, t, f"test-{i}") for i, t in enumerate(tasks)), return_exceptions=True)

    return asyncio.run(all_of_them())


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_the_example_agent_plays_with_the_policy_and_its_calls_are_the_segments_id_for_id(backend, tmp_path, request):
    env_file = AGENT_ENV if backend == "local" else _docker(_env(tmp_path, None), request.getfixturevalue("agent_image"))
    engine = EngineThread(LocalEngine(STARTER, version=0, max_batch=8))
    recording = Recording(engine)
    try:
        trajectories = _play(env_file, recording, count=8)
    finally:
        engine.shutdown()
    assert not [t for t in trajectories if isinstance(t, Exception)], trajectories
    segments = [s for t in trajectories for s in t.segments]
    assert sorted((list(s.prompt_ids), list(s.generated_ids)) for s in segments) == sorted(recording.returned)
    assert all(first_chain_break(t.segments) is None for t in trajectories)
    assert any(len(t.segments) >= 2 for t in trajectories), "no episode used the calculator: nothing multi-turn was checked"
    assert {t.reward for t in trajectories} <= {0.0, 1.0} and all(t.info["exit_code"] == 0 for t in trajectories if t.info["end"] == "exit")


ISOLATION_PROBE = '''
import json, os, socket, sys
from openai import OpenAI
task = json.load(sys.stdin)
seen = {"task_keys": sorted(task), "uid": os.getuid()}
for port in (5432, int(os.environ.get("HOST_ENDPOINT_PORT", "1"))):  # the host's PostgreSQL, the endpoint's TCP port
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        seen[f"port_{port}"] = "reached"
    except OSError as exc:
        seen[f"port_{port}"] = type(exc).__name__
for path in ("/tmp/.loopline-model.sock", "/run/loopline-model.sock"):  # (bubblewrap's, Docker's)
    if os.path.exists(path):
        try:
            os.unlink(path)
            seen["socket_removed"] = True
        except OSError as exc:
            seen["socket_removed"] = type(exc).__name__
reply = OpenAI().chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
seen["model_said"] = reply.choices[0].message.content
open("answer.txt", "w").write(json.dumps(seen))
'''


@pytest.mark.parametrize("backend", ["local", "docker"])
def test_the_program_reaches_the_model_and_nothing_else_and_never_sees_the_answer(backend, tmp_path, monkeypatch, request):
    from loopline.rollout.harness import agent_program

    port = agent_program.endpoint().port
    env_file = _env(tmp_path, ISOLATION_PROBE)
    if backend == "docker":
        _docker(env_file, request.getfixturevalue("agent_image"))
    spec = yaml.safe_load(env_file.read_text())
    spec["agent"]["env"] = {"HOST_ENDPOINT_PORT": str(port)}
    env_file.write_text(yaml.safe_dump(spec))
    chat = ChatFormat.for_policy(STARTER)
    read = {}
    original = __import__("loopline.envregistry.episode", fromlist=["Episode"]).Episode.verify

    async def keep_answer(self, final):
        read["answer"] = final
        return await original(self, final)

    monkeypatch.setattr("loopline.envregistry.episode.Episode.verify", keep_answer)
    (trajectory,) = _play(env_file, Scripted(chat, ["hello"]))
    assert not isinstance(trajectory, Exception), trajectory
    import json

    seen = json.loads(read["answer"])
    assert seen["task_keys"] == ["id", "prompt", "system_prompt"]  # not the task's expression and answer
    assert seen["port_5432"] == "ConnectionRefusedError" and seen[f"port_{port}"] == "ConnectionRefusedError"  # its own empty network
    assert seen["socket_removed"] in ("OSError", "PermissionError")  # a mount point: not removable
    assert seen["model_said"] == "hello" and len(trajectory.segments) == 1
    import os

    if backend == "docker":
        from loopline.envregistry.sandbox.docker import AGENT_UIDS

        assert AGENT_UIDS[0] <= seen["uid"] < AGENT_UIDS[1]  # the container's own agent uid, as for tool commands
    elif os.geteuid() == 0:
        assert seen["uid"] == 65534  # loopline as root: the program runs as an unprivileged uid


CRASH_AFTER_A_CALL = '''
from openai import OpenAI
OpenAI().chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
raise SystemExit("the program gave up")
'''
NO_CALL = 'import sys; sys.exit("cannot even start")'
TOO_MANY_CALLS = '''
from openai import OpenAI
client = OpenAI()
messages = [{"role": "user", "content": "hi"}]
for _ in range(10):
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "again"}]
'''
SLOW_PROGRAM = '''
import time
from openai import OpenAI
OpenAI().chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
time.sleep(30)
'''
TWO_SLOW_CALLS = '''
from openai import OpenAI
client = OpenAI()
messages = [{"role": "user", "content": "hi"}]
for _ in range(2):
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "again"}]
open("answer.txt", "w").write("<answer>0</answer>")
'''

PARALLEL_THEN_REWRITTEN = '''
import asyncio
from openai import AsyncOpenAI
client = AsyncOpenAI()
ask = lambda messages: client.chat.completions.create(model="policy", messages=messages)
async def main():
    # two calls at once (as asyncio.gather does), then a history rewritten with a new system prompt
    await asyncio.gather(ask([{"role": "user", "content": "one"}]), ask([{"role": "user", "content": "two"}]))
    await ask([{"role": "system", "content": "steps left: 1"}, {"role": "user", "content": "three"}])
    open("answer.txt", "w").write("<answer>0</answer>")
asyncio.run(main())
'''

REFUSED_ONLY = '''
from openai import OpenAI
OpenAI().chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], n=2)
'''


def test_failures_are_classified_as_the_harness_classifies_them(tmp_path):
    chat = ChatFormat.for_policy(STARTER)
    (crashed,) = _play(_env(tmp_path / "a", CRASH_AFTER_A_CALL), Scripted(chat, ["x"]))
    assert crashed.failure_type == "task_failed" and crashed.info["exit_code"] == 1 and "gave up" in crashed.info["stderr"]
    (nothing,) = _play(_env(tmp_path / "b", NO_CALL), Scripted(chat, []))
    assert isinstance(nothing, InfraFailure) and "never called the model" in str(nothing) and "cannot even start" in str(nothing)
    # every call refused by the endpoint (smolagents' tool_choice "required", refused then, was retried as infrastructure
    # until the run stopped): the program's failure, scored 0, its one segment the task's prompt with nothing to train
    (refused,) = _play(_env(tmp_path / "r", REFUSED_ONLY), Scripted(chat, []))
    assert not isinstance(refused, Exception), refused
    assert (refused.failure_type, refused.reward, refused.info["end"], refused.info["refusals"]) == ("task_failed", 0.0, "refused", 1)
    assert refused.info["refused"][0].startswith("400 invalid_request_error: n: ") and refused.info["exit_code"] == 1
    (only,) = refused.segments
    assert only.generated_ids == [] and only.prompt_ids and refused.validate() is None
    # issue 48: calls made at once and a rewritten history were discarded but the last chain's; every call is kept
    (chained,) = _play(_env(tmp_path / "p", PARALLEL_THEN_REWRITTEN), Scripted(chat, ["a", "b", "c"]))
    assert not isinstance(chained, Exception), chained
    assert [s.starts_chain for s in chained.segments] == [False, True, True] and chained.info["chains"] == 3
    assert chained.validate() is None and first_chain_break(chained.segments) is None
    (spent,) = _play(_env(tmp_path / "c", TOO_MANY_CALLS), Scripted(chat, ["x"] * 10))
    assert (spent.failure_type, spent.info["end"], len(spent.segments)) == ("truncated", "turns", 3)
    # (budgets of 5 s: a python3 that imports the openai SDK can take 2 s to start on a loaded machine)
    (slow,) = _play(_env(tmp_path / "d", SLOW_PROGRAM, wall_time_s=5), Scripted(chat, ["x"]))
    assert (slow.failure_type, slow.info["end"]) == ("truncated", "wall_time") and slow.timings["episode_s"] < 25
    # waiting for a slow model is not the program's time, also while the call is in flight: 2 calls of 6 s each
    # within a 5 s budget finish (a call longer than the budget was cut, then "never called the model": infra)
    (waited,) = _play(_env(tmp_path / "e", TWO_SLOW_CALLS, wall_time_s=5), Scripted(chat, ["x", "y"], delay_s=6.0))
    assert not isinstance(waited, Exception), waited
    assert (waited.failure_type, waited.info["end"], len(waited.segments)) == ("task_failed", "exit", 2), waited.info


# What the program leaves as answer.txt (it is the agent's, so any file at all) -> the reward it truly earned.
# The model replies with the right answer; the program writes it (or not) as below. Each was a crash of the
# evaluation or an infrastructure failure of every attempt ("no group to train on").
ANSWER_FILES = {
    "a_link_out_of_the_workdir": ("os.symlink('/etc/hostname', 'answer.txt')", 0.0),
    "a_fifo_nobody_writes": ("os.mkfifo('answer.txt')", 0.0),
    "a_directory": ("os.mkdir('answer.txt')", 0.0),
    "invalid_utf8_around_the_right_answer": ("open('answer.txt', 'wb').write(b'\\xff\\xfe' + reply.encode() + b'\\x80')", 1.0),
    "nul_bytes_around_the_right_answer": ("open('answer.txt', 'wb').write(b'\\x00' + reply.encode() + b'\\x00')", 1.0),
}
ANSWER_PROGRAM = """
import os
from openai import OpenAI
reply = OpenAI().chat.completions.create(model="policy", messages=[{{"role": "user", "content": "hi"}}]).choices[0].message.content
{leave}
"""


@pytest.mark.parametrize("backend", ["local", "docker"])
@pytest.mark.parametrize("case", sorted(ANSWER_FILES))
def test_an_answer_file_the_agent_made_odd_is_scored_never_a_crash(case, backend, tmp_path, request):
    leave, earned = ANSWER_FILES[case]
    env_file = _env(tmp_path, ANSWER_PROGRAM.format(leave=leave))
    if backend == "docker":
        env_file = _docker(env_file, request.getfixturevalue("agent_image"))
    task = next(t for t in prepare(env_file).tasks if t.split == "train")
    (played,) = _play(env_file, Scripted(ChatFormat.for_policy(STARTER), [f"<answer>{task.data['answer']}</answer>"]))
    assert not isinstance(played, Exception), played
    assert (played.reward, played.failure_type) == (earned, None if earned else "task_failed"), played.info


def test_a_program_in_docker_is_classified_alike_and_stopped_at_its_wall_time(tmp_path, agent_image):
    chat = ChatFormat.for_policy(STARTER)
    (crashed,) = _play(_docker(_env(tmp_path / "a", CRASH_AFTER_A_CALL), agent_image), Scripted(chat, ["x"]))
    assert crashed.failure_type == "task_failed" and crashed.info["exit_code"] == 1 and "gave up" in crashed.info["stderr"]
    started = time.monotonic()
    (slow,) = _play(_docker(_env(tmp_path / "b", SLOW_PROGRAM, wall_time_s=5), agent_image), Scripted(chat, ["x"]))
    assert (slow.failure_type, slow.info["end"]) == ("truncated", "wall_time") and time.monotonic() - started < 25


def test_the_coding_agent_fixes_its_file_after_the_import_error_and_the_hidden_tests_score_it(agent_image):
    """examples/coding_agent.py in Docker: a reply that does not import is shown its error and answered with the
    reference solution (reward 1 from coding_env's hidden tests); code that imports but is wrong scores what it passes."""
    chat = ChatFormat.for_policy(STARTER)
    env_file = ROOT / "examples" / "coding_agent_env.yaml"
    prepared = prepare(env_file)
    task = next(t for t in prepared.tasks if t.id == "c01")  # add_pair(a, b): two hidden tests
    setup = EpisodeSetup(prepared.spec, 1, chat, SamplingParams(temperature=1.0, max_new_tokens=64))

    def play(replies):
        return asyncio.run(run_episode(Scripted(chat, replies), setup, task, "coding"))

    fixed = play(["```python\ndef add_pair(a, b)\n    return a + b\n```", f"```python\n{task.data['solution']}```"])
    assert (fixed.reward, fixed.failure_type, len(fixed.segments)) == (1.0, None, 2), fixed.info
    shown = chat.tokenizer.decode(fixed.segments[1].prompt_ids)
    assert "Importing solution.py failed" in shown and "SyntaxError" in shown
    wrong = play(["```python\ndef add_pair(a, b):\n    return a - b\n```"])
    assert (wrong.reward, wrong.failure_type, len(wrong.segments)) == (0.0, "task_failed", 1), wrong.info


@pytest.mark.slow
def test_loopline_train_trains_an_agent_program_and_the_ledger_holds_its_calls(database_url, db, tmp_path):
    """The main job on an agent env: 2 steps; every invariant `loopline check` verifies holds on its ledger."""
    import os
    import sys

    from tests.integration.test_chaos import _checked_run, _rows

    name = f"agent-{tmp_path.name[-12:]}".replace("_", "-")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "env": str(AGENT_ENV), "policy": str(STARTER), "steps": 2,
        "rollout": {"groups_per_step": 4, "group_size": 4, "concurrency": 16, "sampling": {"max_new_tokens": 48}}, "learner": {"lr": 3e-4, "backend": "torch"}, "eval": {"every": 2, "tasks": 8},
    }))
    env = {**os.environ, "LOOPLINE_DATABASE_URL": database_url, "LOOPLINE_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # its own temporary Prefect server, as a user without one stands
    done = subprocess.run([sys.executable, "-m", "loopline.cli", "train", str(config)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "View at http" not in done.stdout + done.stderr  # no link to the temporary Prefect server that died with the command
    run_id = _checked_run(db, name)
    trained = _rows(db, "SELECT count(*) FROM consumption WHERE run_id = :r", r=run_id)[0][0]
    assert trained == 2 * 4 * 4
    multi = _rows(db, "SELECT count(*) FROM (SELECT trajectory_id FROM segment s JOIN trajectory t ON t.id = s.trajectory_id "
                      "WHERE t.run_id = :r GROUP BY 1 HAVING count(*) > 1) x", r=run_id)[0][0]
    assert multi > 0  # the program's second call (after its calculator) is in the ledger, chained (check verified it)
    assert _rows(db, "SELECT count(*) FROM eval_result WHERE run_id = :r", r=run_id)[0][0] >= 2  # v0 and v2, by the program too


@pytest.mark.slow
def test_a_trainer_killed_mid_episode_leaves_no_program_behind_and_the_run_resumes_exactly_once(database_url, db, tmp_path):
    """SIGKILL of the trainer's main pid (as the OOM killer does) while agent programs are in flight: they die
    with it (bubblewrap's die-with-parent), their slots are played again by the resumed trainer, and everything
    is trained exactly once."""
    import os

    from tests.integration.test_chaos import _checked_run, _rows, _train

    name = f"agent-kill-{tmp_path.name[-12:]}".replace("_", "-")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "env": str(AGENT_ENV), "policy": str(STARTER), "steps": 2,
        "rollout": {"groups_per_step": 4, "group_size": 4, "concurrency": 8, "lease_seconds": 3, "sampling": {"max_new_tokens": 48}}, "learner": {"lr": 3e-4, "backend": "torch"},
        "eval": {"every": 2, "tasks": 4},
    }))
    # the trainer's sandboxes are made here: the check below sees only them (not under tmp_path: pytest's
    # directories are 0700, and bwrap runs as the agent's uid when loopline runs as root)
    tmpdir = Path(tempfile.mkdtemp(prefix="loopline-kill-test-", dir="/tmp"))
    tmpdir.chmod(0o755)
    env = {
        **os.environ, "LOOPLINE_DATABASE_URL": database_url, "LOOPLINE_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "TMPDIR": str(tmpdir),
    }
    leftovers: list[str] = []
    log = tmp_path / "killed.log"
    assert _train(config, env, "rollout_commit", log, leftovers) == -9, log.read_text()[-3000:]
    assert leftovers == [], f"the killed trainer left {leftovers} running"
    # sandboxed programs run in sessions of their own (not in the trainer's process group): found by their sandbox
    deadline = time.monotonic() + 15
    while (programs := _sandbox_processes(tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert programs == [], f"agent programs outlived the killed trainer: {programs}"
    log = tmp_path / "final.log"
    assert _train(config, env, None, log) == 0, log.read_text()[-3000:]
    run_id = _checked_run(db, name)
    consumed, distinct = _rows(db, "SELECT count(*), count(DISTINCT trajectory_id) FROM consumption WHERE run_id = :r", r=run_id)[0]
    assert consumed == distinct == 2 * 4 * 4
    # the episodes in flight at the kill were played again: their first attempts ended without a trajectory
    assert _rows(db, "SELECT count(*) FROM attempt WHERE run_id = :r AND status NOT IN ('ok', 'task_failed')", r=run_id)[0][0] > 0
    shutil.rmtree(tmpdir, ignore_errors=True)


def test_envreg_test_plays_the_program_against_scripted_replies(tmp_path):
    from loopline.envregistry.smoke import run_smoke
    from loopline.envregistry.spec import parse_spec

    prepared = prepare(AGENT_ENV)
    tasks = [t for t in prepared.tasks if t.split == "train"][:2]
    from loopline.rollout.harness.agent_program import play_scripted

    play = functools.partial(play_scripted, policy=STARTER)
    results = [asyncio.run(run_smoke(prepared.spec, t, play)) for t in tasks]
    assert [r.reward for r in results] == [1.0, 1.0] and all(r.passed(1.0) for r in results)
    assert [s.output for s in results[0].steps] == [f"<calc>{tasks[0].data['expression']}</calc>", f"<answer>{tasks[0].data['answer']}</answer>"]
    wrong = prepared.spec.model_copy(update={"smoke_test": prepared.spec.smoke_test.model_copy(update={"replies": ("<answer>-1</answer>",)})})
    assert asyncio.run(run_smoke(wrong, tasks[0], play)).reward == 0.0  # the verifier, not the script, decides
    spec = yaml.safe_load(AGENT_ENV.read_text())
    spec["smoke_test"] = {"steps": [{"answer": "x"}]}
    with pytest.raises(Exception, match="scripts the model's `replies`"):
        parse_spec(yaml.safe_dump(spec), tmp_path / "env.yaml")


LONG_SYSTEM_PROMPT = '''
from openai import OpenAI
OpenAI().chat.completions.create(model="policy", messages=[{"role": "system", "content": "Think step by step. " * 800},
                                                         {"role": "user", "content": "hi"}])
'''


def test_envreg_test_refuses_a_prompt_past_the_context_as_the_engine_would(tmp_path):
    """smolagents' CodeAgent sends a ~7,400-token system prompt: `envreg test` passed it (its scripted model read no
    length) and the training run's engine then refused every call. The scripted model now refuses it too, and the
    result says why."""
    from loopline.envregistry.smoke import run_smoke
    from loopline.rollout.harness.agent_program import play_scripted

    prepared = prepare(_env(tmp_path, LONG_SYSTEM_PROMPT))
    task = next(t for t in prepared.tasks if t.split == "train")
    result = asyncio.run(run_smoke(prepared.spec, task, functools.partial(play_scripted, policy=STARTER)))
    assert result.reward == 0.0 and result.infra_error is None, result
    assert "every model call of the program was refused" in result.answer and "context_length_exceeded" in result.answer, result.answer
    assert "exceeds the policy's context of 1024" in result.answer, result.answer


def test_envreg_test_plays_a_spec_file_before_it_is_registered_without_any_ledger(tmp_path):
    """`envreg test FILE.yaml` (the `envreg` command as installed): no database is configured or started."""
    import os
    import sys

    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "LOOPLINE_DATABASE_URL"} | {"LOOPLINE_HOME": str(home)}
    for spec in (AGENT_ENV, ROOT / "examples" / "arithmetic_env.yaml"):
        done = subprocess.run([sys.executable, "-c", "from loopline.envreg import app; app()", "test", str(spec), "--tasks", "2"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "not registered" in done.stdout and done.stdout.count(" ok ") == 2, done.stdout
    assert not (home / "pgdata").exists()  # nothing started an embedded PostgreSQL
