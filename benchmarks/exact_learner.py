"""What torch's deterministic algorithms would cost the learner: on vs off, side by side.

    python -m benchmarks.exact_learner [--model DIR] [--steps 3] [--rounds 3] [--load 0]

Issue 29: a resume and `loopline replay` compare a rebuilt version's sha256 with the recorded one, so a
CPU step must be bit-exact under load. The cause of the differences was one kernel (the shared prompt's
gradient summed with atomic adds; `trainer/prefix.py` now uses index_select); switching torch's
deterministic mode on for the whole learner would also have fixed it, at the cost this measures (it
was measured 1.44x on SmolLM2, so the learner does not switch it on).
The work: issue 16's batch (64 sequences, 8 prompts x 8 samples, 49-token prompts: every group shares
its prompt, so the shared-prefix path runs), one learner per variant, alternated in one process so machine
noise hits both alike; `--load N` starts N busy processes beside it (the condition the digests used to
differ under). Prints median seconds per step (first step of a round excluded) and their ratio, and how
many distinct weight digests each variant's rounds ended with (exact: 1).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.learner_step import _batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (default: the shipped tiny starter)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the benchmark")
    args = parser.parse_args()

    import torch

    from loopline.policies.sources import SHIPPED_STARTERS
    from loopline.trainer.learner import Learner, LearnerConfig

    model = Path(args.model) if args.model else next(SHIPPED_STARTERS.glob("tiny-*"))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        vocab = None
        times: dict[bool, list[float]] = {True: [], False: []}
        digests: dict[bool, set[str]] = {True: set(), False: set()}
        for _ in range(args.rounds):
            for exact in (True, False):
                torch.use_deterministic_algorithms(exact)
                learner = Learner(model, LearnerConfig(lr=1e-5), backend="deepspeed")
                vocab = vocab or learner.model.config.vocab_size
                batch = _batch(vocab)
                for step in range(args.steps):
                    started = time.perf_counter()
                    learner.rl_step(batch)
                    if step:
                        times[exact].append(time.perf_counter() - started)
                digests[exact].add(learner.weights_sha256())
                del learner
    finally:
        for hog in hogs:
            hog.kill()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{model.name}: 64 sequences sharing 8 prompts, {args.steps} steps x {args.rounds} rounds, {args.load} busy processes beside, "
          f"torch threads {torch.get_num_threads()}")
    print(f"  deterministic on : {on:.3f} s/step, distinct digests {len(digests[True])}")
    print(f"  deterministic off: {off:.3f} s/step, distinct digests {len(digests[False])}")
    print(f"  on / off: {on / off:.2f}x")


if __name__ == "__main__":
    main()
