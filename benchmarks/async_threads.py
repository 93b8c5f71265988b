"""Async on CPU: a learner step beside a generating engine, with and without splitting the cores between them.

    python -m benchmarks.async_threads --model DIR [--rounds 2]

One process, as `mode: async` with the local rollout worker runs: LocalEngine generates 64 requests
(8 prompts x 8 samples, 32 new tokens, fixed seeds) on a thread of its own while the main thread runs a
learner step on issue 16's batch (64 SmolLM2-sized sequences). Variants, side by side, alternated:
  alone    - the step, then the generation (what sync does: one after the other)
  together - both at once, each thread with torch's default intra-op threads (all cores each)
  split    - both at once, each thread limited to half the cores (torch.set_num_threads in that thread)
Prints each part's seconds and each variant's wall time as a ratio of `alone`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time

from benchmarks.learner_step import _batch


def _generate(engine, threads: int | None, out: dict) -> None:
    import torch

    from loopline.rollout.engines.base import SamplingParams

    if threads:
        torch.set_num_threads(threads)

    async def run() -> None:
        prompts = [[(17 * p + 3 * i) % 4000 + 100 for i in range(49)] for p in range(8)]
        await asyncio.gather(*(
            engine.generate(prompts[p], SamplingParams(temperature=1.0, max_new_tokens=32, seed=8 * p + k), f"r{p}-{k}")
            for p in range(8) for k in range(8)
        ))
        await engine.close()

    started = time.perf_counter()
    asyncio.run(run())
    out["generate_s"] = time.perf_counter() - started


def _learn(learner, batch, threads: int | None, out: dict) -> None:
    import torch

    default = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    learner.rl_step(batch)
    out["learn_s"] = time.perf_counter() - started
    torch.set_num_threads(default)


def variant(name: str, model: str, learner, batch) -> dict:
    from loopline.rollout.engines.local import LocalEngine

    engine = LocalEngine(model, max_batch=32, prefix_cache_mb=0)
    cores = os.cpu_count() or 2
    out: dict = {}
    started = time.perf_counter()
    if name == "alone":
        _learn(learner, batch, None, out)
        _generate(engine, None, out)
    else:
        half = max(1, cores // 2) if name == "split" else None
        thread = threading.Thread(target=_generate, args=(engine, half, out))
        thread.start()
        _learn(learner, batch, half, out)
        thread.join()
    out["wall_s"] = time.perf_counter() - started
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory, e.g. the one `loopline models pull smollm2-135m` writes")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from loopline.trainer.learner import Learner, LearnerConfig

    learner = Learner(args.model, LearnerConfig(lr=1e-6, micro_batch_tokens=16384), backend="deepspeed")
    batch = _batch(learner.model.config.vocab_size)
    learner.rl_step(batch)  # warm-up
    results: dict[str, list[dict]] = {"alone": [], "together": [], "split": []}
    for _ in range(args.rounds):
        for name in results:
            results[name].append(variant(name, args.model, learner, batch))
            print(name, {k: round(v, 1) for k, v in results[name][-1].items()}, flush=True)
    alone = statistics.median(r["wall_s"] for r in results["alone"])
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("learn_s", "generate_s", "wall_s")}
        print(f"{name:8s}: learner step {med['learn_s']:6.1f} s, generation {med['generate_s']:6.1f} s, wall {med['wall_s']:6.1f} s "
              f"= {med['wall_s'] / alone:.2f} x alone")


if __name__ == "__main__":
    main()
