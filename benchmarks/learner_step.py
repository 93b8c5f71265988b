"""One learner step on issue 16's work, before and after its changes, side by side: seconds and peak memory.

    python -m benchmarks.learner_step --model DIR [--steps 4] [--rounds 2] [--backend deepspeed]

The work: 64 sequences (8 prompts x 8 samples), a 49-token prompt and 26-32 generated tokens each
(issue 16's SmolLM2 arithmetic measurement), one optimizer step, TIS, token-mean loss. Variants, each in
its own process (so peak RSS is its own), alternated so machine noise hits both alike:
  before - logits over the whole vocabulary at every position, and a separate π_old forward pass;
  after  - logits only where an action token is predicted, and the loss's forward as π_old.
Prints the median seconds per step (first step excluded) and peak RSS of each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _batch(vocab: int, seed: int = 0):
    from loopline.trainer.batch import TrainSequence

    rng = random.Random(seed)
    out = []
    for prompt_index in range(8):
        prompt = tuple(rng.randrange(vocab) for _ in range(49))
        for k in range(8):
            n = rng.randint(26, 32)
            ids = prompt + tuple(rng.randrange(vocab) for _ in range(n))
            mask = (0,) * 49 + (1,) * n
            mu = (0.0,) * 49 + tuple(-rng.random() * 4 for _ in range(n))
            out.append(TrainSequence(None, prompt_index, float(k % 2), ids, mask, mu))
    return out


def _before(learner_module) -> None:
    """The learner as it was: full-vocabulary log_softmax everywhere, π_old from a separate pass."""
    import torch.nn.functional as F

    def full(self, batch):
        logits = self.backend.forward(batch.input_ids.to(self.device), batch.attention_mask.to(self.device))
        logits = logits[:, :-1].float() / self.config.temperature
        return F.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[:, 1:].to(self.device)[..., None])[..., 0]

    learner_module.Learner._logprobs = full


def child(model: str, variant: str, steps: int, backend: str) -> None:

    from loopline.trainer import learner as learner_module
    from loopline.trainer.learner import Learner, LearnerConfig
    from loopline.trainer.losses import loss_settings

    loss = loss_settings()
    if variant == "before":
        _before(learner_module)
        loss = loss_settings(correction="mis", correction_cap=1e30)  # keeps the separate π_old pass, rejects nothing
    learner = Learner(model, LearnerConfig(lr=1e-6, micro_batch_tokens=16384, loss=loss), backend=backend)
    times, peak_gb = timed_steps(learner, steps)
    print(json.dumps({"variant": variant, "times": times, "peak_gb": peak_gb}))


def timed_steps(learner, steps: int, batch=None) -> tuple[list[float], float]:
    """Seconds of each of `steps` RL steps on `batch` (default: this benchmark's), and the process's peak RSS
    after them (GiB: ru_maxrss is in KiB)."""
    batch = batch or _batch(learner.model.config.vocab_size)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        learner.rl_step(batch)
        times.append(time.perf_counter() - started)
    return times, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory, e.g. the one `loopline models pull smollm2-135m` writes")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="deepspeed", choices=["deepspeed", "torch"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child, args.steps, args.backend)
        return
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for variant in ("before", "after"):
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.learner_step", "--model", args.model, "--steps", str(args.steps),
                 "--backend", args.backend, "--child", variant],
                cwd=ROOT, capture_output=True, text=True, check=True,
            )
            results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {}
    for variant, runs in results.items():
        times = [t for r in runs for t in r["times"][1:]]
        summary[variant] = (statistics.median(times), max(r["peak_gb"] for r in runs))
        print(f"{variant:6s}: {summary[variant][0]:6.2f} s per step (median of {len(times)}), peak RSS {summary[variant][1]:.2f} GB")
    (tb, mb), (ta, ma) = summary["before"], summary["after"]
    print(f"after / before: time {ta / tb:.2f}, peak memory {ma / mb:.2f}")


if __name__ == "__main__":
    main()
