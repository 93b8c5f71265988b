"""The agent harness: token-exact segments, masks, observations as ids, budgets and failure classes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from loopline.envregistry.spec import LocalSettings, load_spec
from loopline.envregistry.tasks import Task
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import EngineError, Generation, SamplingParams, VersionSpan
from loopline.rollout.harness.episode import EpisodeSetup, run_episode
from loopline.rollout.engines.local import LocalEngine, load_model
from loopline.store import ledger

ARITHMETIC = Path(__file__).resolve().parents[2] / "examples" / "arithmetic_env.yaml"
TASK = Task("t1", "train", "What is 12 + 3 * 4?", {"expression": "12 + 3 * 4", "answer": 24})


@pytest.fixture(scope="module")
def chat(tiny_dirs):
    return ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(tiny_dirs["v0"]))


def _setup(chat, **budgets):
    spec = load_spec(ARITHMETIC)
    if budgets:
        spec = spec.model_copy(update={"budgets": spec.budgets.model_copy(update=budgets)})
    return EpisodeSetup(spec, 1, chat, SamplingParams(temperature=1.0, max_new_tokens=48, seed=0))


class ScriptedEngine:
    """A test double for the harness's control flow: it 'generates' scripted texts (real token ids, fake logprobs)."""

    def __init__(self, chat: ChatFormat, turns: list[str], finish: str = "stop"):
        self.chat, self.turns, self.finish, self.prompts = chat, list(turns), finish, []

    def version(self) -> int:
        return 3

    async def generate(self, prompt_ids, sampling, request_id):
        self.prompts.append(list(prompt_ids))
        ids = self.chat.tokenizer.encode(self.turns.pop(0), add_special_tokens=False)
        if self.finish == "stop":
            ids.append(self.chat.eos_id)
        ids = ids[: sampling.max_new_tokens]
        return Generation(tuple(ids), tuple([-1.0] * len(ids)), self.finish, (VersionSpan(3, 0, len(ids)),))


def test_multi_turn_episode_appends_observations_as_ids(chat):
    engine = ScriptedEngine(chat, ["<calc>12 + 3 * 4</calc>", "<calc>oops(</calc>", "so <answer>24</answer>"])
    traj = asyncio.run(run_episode(engine, _setup(chat), TASK, "ep1"))
    assert (traj.reward, traj.terminated, traj.truncated, traj.failure_type) == (1.0, True, False, None)
    first, second, third = traj.segments
    # never re-tokenised: each prompt is the previous prompt + its generated ids + the observation turn
    for before, after, shown in ((first, second, "<result>24</result>"), (second, third, "<result>error: cannot parse 'oops('</result>")):
        head = list(before.prompt_ids) + list(before.generated_ids)
        assert list(after.prompt_ids[: len(head)]) == head
        tail = chat.tokenizer.decode(after.prompt_ids[len(head) :])
        assert tail == f"\n<|im_start|>user\n{shown}<|im_end|>\n<|im_start|>assistant\n"
    assert engine.prompts == [list(s.prompt_ids) for s in traj.segments]
    assert all(list(s.action_loss_mask) == [1] * len(s.generated_ids) for s in traj.segments)
    assert first.tool_events[0]["tool"] == "calc" and first.tool_events[0]["output"] == "24"
    assert second.tool_events[0]["error"] and first.policy_version == 3
    assert {s.request_id for s in traj.segments} == {"ep1/t0/", "ep1/t1/", "ep1/t2/"}


def test_budgets_end_an_episode_as_truncated(chat):
    turns = asyncio.run(run_episode(ScriptedEngine(chat, ["<calc>1+1</calc>"] * 3), _setup(chat), TASK, "e"))
    assert (turns.truncated, turns.failure_type, turns.info["end"], len(turns.segments)) == (True, "truncated", "turns", 3)
    tokens = asyncio.run(run_episode(ScriptedEngine(chat, ["<calc>1+1</calc> " * 20], "length"), _setup(chat, max_generated_tokens=10), TASK, "e"))
    assert tokens.truncated and tokens.info["end"] == "tokens" and len(tokens.segments[0].generated_ids) == 10
    assert tokens.reward == 0.0


def test_unclosed_tool_call_is_told_to_the_model(chat):
    engine = ScriptedEngine(chat, ["<calc>1 + 1", "<answer>2</answer>"])
    traj = asyncio.run(run_episode(engine, _setup(chat), TASK, "e"))
    assert traj.segments[0].tool_events[0]["output"] == "error: <calc> was opened but never closed with </calc>"
    assert traj.reward == 0.0 and traj.failure_type == "task_failed"


def test_aborted_generation_is_an_engine_error_not_a_reward(chat):
    with pytest.raises(EngineError, match="aborted"):
        asyncio.run(run_episode(ScriptedEngine(chat, ["partial"], "abort"), _setup(chat), TASK, "e"))


class Recorder:
    """Passes every call through to the real engine and keeps what it returned."""

    def __init__(self, engine):
        self.engine, self.returned = engine, {}

    def version(self):
        return self.engine.version()

    async def generate(self, prompt_ids, sampling, request_id):
        gen = await self.engine.generate(prompt_ids, sampling, request_id)
        self.returned[request_id] = gen
        return gen


def test_groups_on_local_engine_are_token_exact_in_the_ledger(tiny_dirs, chat, db, run):
    """The Done-when test of issue 4: real engine, real environment, committed and read back token by token."""
    setup = _setup(chat)
    tasks = [Task(f"t{i}", "train", f"What is {i} + {i}?", {"expression": f"{i} + {i}", "answer": 2 * i}) for i in range(3)]
    ledger.plan_step(db, run.id, 1, [t.id for t in tasks], group_size=2)
    leases = ledger.claim_slots(db, run.id, "w", 6, split="train")
    by_id = {t.id: t for t in tasks}
    engine = Recorder(LocalEngine(tiny_dirs["v0"]))

    async def play():
        return await asyncio.gather(*(run_episode(engine, setup, by_id[l.task_id], f"{l.attempt_id}") for l in leases))

    trajectories = asyncio.run(play())
    outcomes = ledger.commit_trajectories(db, list(zip([l.attempt_id for l in leases], trajectories)))
    assert all(o.committed for o in outcomes)
    rows = db.execute(
        sa.text(
            "SELECT s.request_id, s.prompt_ids, s.generated_ids, s.action_loss_mask, s.rollout_logprobs::float8[] AS rollout_logprobs, s.policy_version "
            "FROM segment s JOIN trajectory t ON t.id = s.trajectory_id WHERE t.run_id = :r"
        ),
        {"r": run.id},
    ).all()
    db.rollback()
    assert len(rows) == sum(len(t.segments) for t in trajectories) >= 6
    model = load_model(tiny_dirs["v0"])
    worst = 0.0
    for row in rows:
        gen = engine.returned[row.request_id]
        assert row.generated_ids == list(gen.token_ids)  # trained tokens are the engine's tokens
        assert row.rollout_logprobs == list(gen.logprobs)  # and its logprobs, bit for bit
        assert row.action_loss_mask == [1] * len(row.generated_ids) and row.policy_version == 0
        ids = torch.tensor([row.prompt_ids + row.generated_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(row.prompt_ids) - 1 : -1] / setup.sampling.temperature
        recomputed = F.log_softmax(logits, -1).gather(1, torch.tensor(row.generated_ids)[:, None])[:, 0]
        worst = max(worst, float((recomputed - torch.tensor(row.rollout_logprobs)).abs().max()))
    print(f"max |recomputed - rollout logprob| = {worst:.2e}")
    assert worst < 1e-4, worst  # same weights, fp32 CPU


def test_context_overflow_ends_the_episode_as_truncated(chat):
    from loopline.rollout.engines.base import ContextOverflow

    class Overflowing(ScriptedEngine):
        async def generate(self, prompt_ids, sampling, request_id):
            if self.prompts:
                raise ContextOverflow("prompt too long")
            return await super().generate(prompt_ids, sampling, request_id)

    traj = asyncio.run(run_episode(Overflowing(chat, ["<calc>1+1</calc>"]), _setup(chat), TASK, "e"))
    assert traj.truncated and traj.info["end"] == "context" and len(traj.segments) == 1


def test_learner_reads_committed_multi_turn_trajectories_token_exact(chat, db, run):
    from loopline.pipeline.stages import load_sequences

    ledger.plan_step(db, run.id, 1, ["t1"], group_size=1)
    (lease,) = ledger.claim_slots(db, run.id, "w", 1, split="train")
    engine = ScriptedEngine(chat, ["<calc>12 + 3 * 4</calc>", "so <answer>24</answer>"])
    traj = asyncio.run(run_episode(engine, _setup(chat), TASK, "ep"))
    outcome = ledger.commit_trajectory(db, lease.attempt_id, traj)
    (seq,) = load_sequences(db, [outcome.trajectory_id])
    first, second = traj.segments
    assert list(seq.input_ids) == list(second.prompt_ids) + list(second.generated_ids)
    starts = [len(first.prompt_ids), len(second.prompt_ids)]
    expected_mask = [0] * len(seq.input_ids)
    for start, seg in zip(starts, traj.segments):
        expected_mask[start : start + len(seg.generated_ids)] = [1] * len(seg.generated_ids)
    assert list(seq.action_mask) == expected_mask  # the observation between the turns is context (mask 0)
    assert [lp for lp, m in zip(seq.behaviour_logprobs, seq.action_mask) if m] == [-1.0] * sum(expected_mask)
    assert seq.reward == 1.0 and seq.group_id == lease.group_id


class OneAtATime(ScriptedEngine):
    """Serves one request at a time, 0.3 s each: a slow engine with a queue in front of it."""

    def __init__(self, chat: ChatFormat):
        super().__init__(chat, [])
        self.lock = asyncio.Lock()

    async def generate(self, prompt_ids, sampling, request_id):
        async with self.lock:
            await asyncio.sleep(0.3)
            ids = self.chat.tokenizer.encode("<answer>24</answer>", add_special_tokens=False) + [self.chat.eos_id]
            return Generation(tuple(ids), tuple([-1.0] * len(ids)), "stop", (VersionSpan(3, 0, len(ids)),))


def _evaluate(engine, setup, run, db, tasks, **held_out):
    """The held-out evaluation of the engine's version 1 (temperature 0, seed 0), as a run's parts build it."""
    from loopline.pipeline.stages import HeldOut, evaluate

    return evaluate(engine, HeldOut(run.id, setup, lambda: db, tasks, env_version=1, temperature=0.0, seed=0, **held_out))


def test_an_evaluation_larger_than_the_concurrency_does_not_time_out_in_the_queue(chat, db, run):
    """12 held-out episodes, a 1 s wall-time budget each, an engine that takes 0.3 s a request one at a time:
    all 12 at once would wait up to 3.6 s before their first call; `concurrency` 2 starts each when it can run."""
    from loopline import activity

    tasks = [Task(f"e{i}", "eval", TASK.prompt, TASK.data) for i in range(12)]
    seen = []

    async def watch_and_evaluate():
        async def watch():
            while True:
                seen.append(activity.snapshot().get("evaluating v3"))
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch())
        try:
            return await _evaluate(OneAtATime(chat), _setup(chat, wall_time_s=1.0), run, db, tasks, concurrency=2)
        finally:
            watcher.cancel()

    assert asyncio.run(watch_and_evaluate()) == 1.0
    # the CLI's run bar shows the evaluation's progress (the ledger records it only at the end), then drops it
    progress = [s for s in seen if s is not None]
    assert progress[0][1] == 12 and any(0 < done < 12 for done, _ in progress) and activity.snapshot() == {}


def test_waiting_for_the_engine_is_not_charged_to_the_wall_time_budget(chat, db, run):
    """Six held-out episodes at once on an engine serving one request at a time (0.3 s each), a 1 s budget: the
    last waits 1.8 s for its only model call. Queueing depends on the load (an async run's rollouts share the
    engine), not on the agent: it must neither truncate the episode nor score it 0 (seen on SmolLM2, issue 17)."""
    tasks = [Task(f"e{i}", "eval", TASK.prompt, TASK.data) for i in range(6)]
    success = asyncio.run(_evaluate(OneAtATime(chat), _setup(chat, wall_time_s=1.0), run, db, tasks, concurrency=6, max_attempts=1))
    assert success == 1.0


def test_the_agents_tool_time_is_bounded_by_the_wall_time_budget(chat, tmp_path):
    from tests.envfiles import write_env

    spec = load_spec(write_env(tmp_path, "slow-tools", [{"id": "a", "split": "train", "prompt": "p"}]))
    run = spec.tools[0].model_copy(update={"command": "sh -c {cmd}"})
    spec = spec.model_copy(update={"tools": (run,), "budgets": spec.budgets.model_copy(update={"wall_time_s": 1.0, "max_turns": 5})})
    setup = EpisodeSetup(spec, 1, chat, SamplingParams(temperature=1.0, max_new_tokens=48, seed=0))
    task = Task("a", "train", "p", {})
    engine = ScriptedEngine(chat, ["<run>sleep 0.6</run>"] * 3 + ["<answer>x</answer>"])
    slow = asyncio.run(run_episode(engine, setup, task, "e"))
    # 0.6 s, then the rest of the budget (a loaded machine may spend it all on the first call's sandbox start)
    assert (slow.truncated, slow.info["end"]) == (True, "wall_time") and len(slow.segments) <= 2
    assert slow.timings["tools_s"] >= 1.0


class FailsFirst(OneAtATime):
    """An engine whose first request for each task fails (a server restarting, a request aborted)."""

    def __init__(self, chat: ChatFormat):
        super().__init__(chat)
        self.failed: set[str] = set()

    async def generate(self, prompt_ids, sampling, request_id):
        task = request_id.split("/")[0]
        if task not in self.failed:
            self.failed.add(task)
            raise EngineError(f"request {request_id} was aborted")
        return await super().generate(prompt_ids, sampling, request_id)


def test_an_evaluation_episode_that_fails_for_infra_reasons_is_played_again(chat, db, run):
    """An engine or sandbox failure says nothing about the policy: the episode is played again (same task and
    seed), and the evaluation completes instead of failing the run."""
    tasks = [Task(f"e{i}", "eval", TASK.prompt, TASK.data) for i in range(3)]
    assert asyncio.run(_evaluate(FailsFirst(chat), _setup(chat), run, db, tasks, concurrency=3)) == 1.0
    with pytest.raises(EngineError, match="aborted"):  # without retries it failed
        asyncio.run(_evaluate(FailsFirst(chat), _setup(chat), run, db, tasks, concurrency=3, max_attempts=1))


def test_a_cancelled_tool_call_leaves_no_process_behind():
    """A rollout worker that stops cancels its episodes; the local backend's command must die with the call."""
    from loopline.envregistry.sandbox.backends import open_sandbox

    async def go():
        box = await open_sandbox(LocalSettings(backend="local"))
        call = asyncio.create_task(box.exec("sleep 37.5", timeout_s=60))
        await asyncio.sleep(1.0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await box.close()

    asyncio.run(go())
    def commands():
        for entry in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                yield entry.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass

    assert not [c for c in commands() if "sleep 37.5" in c]
