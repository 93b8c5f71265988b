"""Learner tokens/s through DeepSpeed vs a plain PyTorch loop, same batch and model, side by side.

    python -m benchmarks.learner_overhead [--hidden 256] [--layers 4] [--steps 4]

Both learners run the same `rl_step` code (decoupled PPO, π_old recompute,
token-budget micro-batches); only the optimizer step differs (DeepSpeed
ZeRO-1 engine vs torch AdamW). Steps alternate between the two so machine
noise hits both alike. The issue's bar: DeepSpeed / torch time <= 1.1.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loopline.trainer.batch import TrainSequence
from loopline.trainer.learner import Learner, LearnerConfig
from loopline.trainer.tiny import build_tiny


def synthetic_batch(groups: int, group_size: int, prompt: int, generated: int, vocab: int, seed: int = 0) -> list[TrainSequence]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for k in range(group_size):
            ids = tuple(rng.randrange(3, vocab) for _ in range(prompt + generated))
            mask = (0,) * prompt + (1,) * generated
            mu = (0.0,) * prompt + tuple(-rng.random() * 4 for _ in range(generated))
            out.append(TrainSequence(None, g, float(k % 2), ids, mask, mu))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny(Path(tmp) / "m", hidden=args.hidden, layers=args.layers)
        batch = synthetic_batch(groups=8, group_size=4, prompt=96, generated=160, vocab=400)
        config = LearnerConfig(lr=1e-5, micro_batch_tokens=4096)
        learners = {name: Learner(model_dir, config, backend=name) for name in ("torch", "deepspeed")}
        for learner in learners.values():
            learner.rl_step(batch)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in learners}
        tokens = sum(s.action_tokens for s in batch)
        for _ in range(args.steps):
            for name, learner in learners.items():
                start = time.perf_counter()
                learner.rl_step(batch)
                times[name].append(time.perf_counter() - start)
    table = Table(title=f"rl_step on {len(batch)} sequences x 256 tokens ({tokens} action tokens), Llama hidden {args.hidden} x {args.layers}")
    for column in ("learner", "median step s", "action tokens/s"):
        table.add_column(column, justify="right")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in learners:
        table.add_row(name, f"{med[name]:.2f}", f"{tokens / med[name]:.0f}")
    console = Console()
    console.print(table)
    console.print(f"DeepSpeed / torch step time: {med['deepspeed'] / med['torch']:.3f} (bar: <= 1.1)")


if __name__ == "__main__":
    main()
