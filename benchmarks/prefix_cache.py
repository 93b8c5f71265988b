"""LocalEngine's prefix cache, on and off side by side: SmolLM2-135M-Instruct plays held-out arithmetic tasks.

    python -m benchmarks.prefix_cache [--tasks 64] [--concurrency 32] [--rounds 2]

Each round plays the same tasks (greedy, the pulled model's calculator demonstrations, the env's budgets)
once with the cache and once without, alternating; prints episodes/s, prompt tokens run through the
model vs taken from the cache, wall-time truncations and success, and the speed ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from benchmarks.smollm2_learning import pulled_model
from loopline.envregistry.spec import load_spec
from loopline.envregistry.tasks import load_tasks
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import EngineError, SamplingParams
from loopline.rollout.harness.episode import EpisodeSetup, run_episode
from loopline.rollout.engines.local import LocalEngine
from loopline.store.db import loopline_home

ROOT = Path(__file__).resolve().parent.parent


async def play(model: Path, tasks, setup: EpisodeSetup, concurrency: int, cache_mb: float) -> dict:
    engine = LocalEngine(model, max_batch=concurrency, prefix_cache_mb=cache_mb)
    slots = asyncio.Semaphore(concurrency)

    async def one(task):
        async with slots:
            try:
                return await run_episode(engine, setup, task, f"{task.id}/")
            except EngineError:  # its wall-time budget ran out before its first model call
                return None

    started = time.monotonic()
    results = await asyncio.gather(*(one(t) for t in tasks))
    wall = time.monotonic() - started
    await engine.close()
    done = [r for r in results if r is not None]
    return {
        "episodes_per_s": len(tasks) / wall, "wall_s": wall, **engine.prefill_tokens,
        "success": statistics.mean(r is not None and r.reward == 1.0 for r in results),
        "out_of_time": sum(r is None or r.info["end"] == "wall_time" for r in results), "episodes": len(done),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model = pulled_model(loopline_home())
    env = ROOT / "examples" / "arithmetic_env.yaml"
    spec = load_spec(env)
    tasks = [t for t in load_tasks(spec, env.parent) if t.split == "eval"][: args.tasks]
    setup = EpisodeSetup(spec, 1, ChatFormat.for_policy(model), SamplingParams(temperature=0.0, max_new_tokens=48, seed=0))
    runs: dict[str, list[dict]] = {"cache": [], "no cache": []}
    print(f"{'':9s} {'episodes/s':>10s} {'prompt tokens run':>17s} {'from cache':>10s} {'out of time':>11s} {'success':>8s}")
    for _ in range(args.rounds):
        for name, mb in (("cache", 1024.0), ("no cache", 0.0)):
            row = asyncio.run(play(model, tasks, setup, args.concurrency, mb))
            runs[name].append(row)
            print(f"{name:9s} {row['episodes_per_s']:10.3f} {row['computed']:17,d} {row['reused']:10,d} {row['out_of_time']:11d} {row['success']:8.1%}", flush=True)
    speed = {name: statistics.median(r["episodes_per_s"] for r in rows) for name, rows in runs.items()}
    print(f"episodes/s with the prefix cache / without: {speed['cache'] / speed['no cache']:.2f}x "
          f"({args.tasks} tasks, concurrency {args.concurrency}, median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
