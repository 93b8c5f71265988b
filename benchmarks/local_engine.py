"""LocalEngine throughput, measured side by side in one run.

    python -m benchmarks.local_engine [--hidden 256] [--layers 4] [--tokens 64]

1. Batched vs one request at a time: the same 16 requests (64 new tokens
   each, EOS ignored) with `max_batch=16` and `max_batch=1`; tokens/s ratio.
2. Concurrency sweep (experiment 1 of seed §10.3): the arithmetic
   environment through the harness and the continuous scheduler at
   concurrency 1/4/8/16: trajectories/s, p50/p95 episode seconds, timeouts,
   and the KV cache the engine held at its fullest decode step beside what
   `loopline plan` estimates for that concurrency (concurrency x the env's
   longest context x KV bytes per token: an upper bound).

The model is a random-init Llama of the given size (a throughput measurement
needs real matrix work, not a trained policy).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from benchmarks._scratch import scratch_database
from loopline.envregistry.spec import load_spec
from loopline.plan import ModelShape, size
from loopline.envregistry.tasks import load_tasks
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import SamplingParams
from loopline.rollout.harness.episode import EpisodeSetup
from loopline.rollout.engines.local import LocalEngine
from loopline.rollout.harness.scheduler import Binding, WorkerConfig, run_continuous
from loopline.store import ledger
from loopline.store.db import session
from loopline.trainer.tiny import build_tiny

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


async def generate_all(model_dir: Path, max_batch: int, n: int, tokens: int) -> float:
    engine = LocalEngine(model_dir, max_batch=max_batch)
    engine.eos_ids = frozenset()  # every request makes exactly `tokens` tokens
    sampling = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=0)
    prompts = [[1] + [(7 * i + j) % 300 + 3 for j in range(20 + i)] for i in range(n)]
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(p, sampling, f"r{i}/") for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


async def sweep_point(model_dir: Path, binding: Binding, db_engine, concurrency: int, episodes: int):
    with session(db_engine) as s:
        run = ledger.create_run(s, f"sweep-{concurrency}-{time.time_ns()}", {"c": concurrency}, str(model_dir))
        ledger.plan_step(s, run.id, 1, list(binding.tasks)[:episodes], group_size=1)
    engine = LocalEngine(model_dir, max_batch=concurrency)
    stats = await run_continuous(engine, binding, lambda: session(db_engine), WorkerConfig(run.id, "sweep", concurrency=concurrency, poll_s=0.02))
    with session(db_engine) as s:
        import sqlalchemy as sa

        ends = s.execute(sa.text("SELECT info->>'end' FROM trajectory WHERE run_id = :r"), {"r": run.id}).scalars().all()
    return stats, sum(e == "wall_time" for e in ends), max(engine.kv_tokens, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--episodes", type=int, default=32)
    args = parser.parse_args()
    console = Console()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny(Path(tmp) / "model", hidden=args.hidden, layers=args.layers)
        single = asyncio.run(generate_all(model_dir, 1, 16, args.tokens))
        batched = asyncio.run(generate_all(model_dir, 16, 16, args.tokens))
        table = Table(title=f"16 requests x {args.tokens} tokens, Llama hidden {args.hidden} x {args.layers} layers")
        for column in ("mode", "tokens/s"):
            table.add_column(column, justify="right")
        table.add_row("one at a time (max_batch=1)", f"{single:.0f}")
        table.add_row("batched (max_batch=16)", f"{batched:.0f}")
        console.print(table)
        console.print(f"batched / one-at-a-time: {batched / single:.2f}x")

        spec = load_spec(EXAMPLES / "arithmetic_env.yaml")
        chat = ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(model_dir))
        tasks = {t.id: t for t in load_tasks(spec, EXAMPLES) if t.split == "train"}
        binding = Binding(EpisodeSetup(spec, 1, chat, SamplingParams(temperature=1.0, max_new_tokens=args.tokens)), tasks)
        sweep = Table(title=f"arithmetic env, {args.episodes} episodes per point, continuous scheduler")
        shape = ModelShape.from_dir(model_dir)
        per_token = shape.kv_bytes_per_token(4)
        prompt = max(len(chat.initial_ids(spec.reset.system_prompt, t.prompt)) for t in list(tasks.values())[: args.episodes])
        longest = prompt + min(spec.budgets.max_generated_tokens, spec.budgets.max_turns * args.tokens)
        for column in ("concurrency", "trajectories/s", "p50 episode s", "p95 episode s", "timeouts", "KV held (peak)", "KV planned"):
            sweep.add_column(column, justify="right")
        with scratch_database() as (_, db_engine):
            for concurrency in (1, 4, 8, 16):
                stats, timeouts, kv_peak = asyncio.run(sweep_point(model_dir, binding, db_engine, concurrency, args.episodes))
                times = sorted(stats.episode_s)
                p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
                sweep.add_row(
                    str(concurrency), f"{stats.committed / stats.wall_s:.2f}", f"{statistics.median(times):.2f}", f"{p95:.2f}", str(timeouts),
                    size(kv_peak * per_token), size(concurrency * longest * per_token),
                )
        console.print(sweep)


if __name__ == "__main__":
    main()
