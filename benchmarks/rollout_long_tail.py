"""Long-tail injection (seed §7.2, experiment 2 of §10.3): barrier vs continuous rollout, side by side.

    python -m benchmarks.rollout_long_tail [--slots 8] [--short 0.25] [--long 2.0] [--tasks 256]

Every task's one tool call sleeps in a real local sandbox: 7 of 8 tasks for
`--short` seconds, 1 of 8 for `--long` (the seed's 10 s / 80 s, scaled down).
The policy is a scripted stand-in (real token ids, it always calls the tool
then answers), because what is measured is the scheduler: slot utilisation
(busy slot-seconds / (wall seconds x slots)) and how the order in which
trajectories are accepted shifts toward short tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from benchmarks._scratch import scratch_database
from loopline.envregistry.spec import EnvSpec
from loopline.envregistry.tasks import Task
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import Generation, SamplingParams, VersionSpan
from loopline.rollout.harness.episode import EpisodeSetup
from loopline.rollout.harness.scheduler import Binding, WorkerConfig, run_barrier, run_continuous
from loopline.store import ledger
from loopline.store.db import session
from loopline.trainer.tiny import build_tiny

SPEC = {
    "name": "long_tail",
    "sandbox": {"backend": "local"},
    "tasks": {"kind": "jsonl", "path": "unused.jsonl"},
    "tools": [{"name": "work", "description": "does slow work", "command": "sleep \"$(cat latency)\"", "timeout_s": 600}],
    "reset": {"files": {"latency": "latency"}},
    "verifier": {"builtin": "arithmetic_answer"},
    "budgets": {"max_turns": 3, "max_generated_tokens": 256, "wall_time_s": 600},
}


class ScriptedPolicy:
    """Benchmark stand-in for a model: calls the tool once, then answers (token ids from the real tokenizer)."""

    def __init__(self, chat: ChatFormat):
        self.chat = chat

    def version(self) -> int:
        return 0

    async def generate(self, prompt_ids, sampling, request_id):
        text = "<work></work>" if request_id.endswith("/t0/") else "<answer>0</answer>"
        ids = self.chat.tokenizer.encode(text, add_special_tokens=False) + [self.chat.eos_id]
        return Generation(tuple(ids), tuple([0.0] * len(ids)), "stop", (VersionSpan(0, 0, len(ids)),))


async def measure(mode: str, binding: Binding, engine, url_engine, n_tasks: int, slots: int):
    with session(url_engine) as s:
        run = ledger.create_run(s, f"long-tail-{mode}-{id(binding)}", {"mode": mode}, "file:///none")
        ledger.plan_step(s, run.id, 1, list(binding.tasks)[:n_tasks], group_size=1)
    cfg = WorkerConfig(run.id, mode, concurrency=slots, poll_s=0.02)
    runner = run_barrier if mode == "barrier" else run_continuous
    return await runner(engine, binding, lambda: session(url_engine), cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--short", type=float, default=0.25)
    parser.add_argument("--long", type=float, default=2.0)
    parser.add_argument("--tasks", type=int, default=256)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(build_tiny(Path(tmp) / "tok")))
    tasks = {
        f"t{i:03d}": Task(f"t{i:03d}", "train", "Do the work.", {"expression": "0", "answer": 0, "latency": str(args.long if i % 8 == 7 else args.short)})
        for i in range(args.tasks)
    }
    binding = Binding(EpisodeSetup(EnvSpec.model_validate(SPEC), 1, chat, SamplingParams()), tasks)
    policy = ScriptedPolicy(chat)
    results = {}
    with scratch_database() as (_, engine):
        for mode in ("barrier", "continuous"):
            results[mode] = asyncio.run(measure(mode, binding, policy, engine, args.tasks, args.slots))

    table = Table(title=f"{args.slots} slots, {args.tasks} tasks: 7/8 take {args.short:g} s, 1/8 take {args.long:g} s")
    for column in ("scheduler", "wall s", "slot utilisation", "long share of first half accepted", "committed"):
        table.add_column(column, justify="right")
    expected_share = 1 / 8
    for mode, stats in results.items():
        half = stats.task_ids[: len(stats.task_ids) // 2]
        long_share = sum(tasks[t].data["latency"] == str(args.long) for t in half) / max(len(half), 1)
        table.add_row(mode, f"{stats.wall_s:.1f}", f"{stats.utilisation(args.slots):.0%}", f"{long_share:.1%} (planned {expected_share:.1%})", str(stats.committed))
    Console().print(table)
    barrier, continuous = (results[m].utilisation(args.slots) for m in ("barrier", "continuous"))
    Console().print(f"continuous / barrier utilisation: {continuous / barrier:.2f}x")


if __name__ == "__main__":
    main()
