"""The race's learner step, before and after the suffix passes, the micro-batches counted by what runs, and the
head on the action positions only: seconds and peak RSS, side by side.

    python -m benchmarks.learner_passes --model DIR [--rounds 1] [--steps 1]

The work is shaped as the race's first real batch was (`loopline replay` of seed 0's step 1, 2026-12-07): 8
prompts of 398 tokens x 8 samples; most samples call the tool once (20-70 generated tokens, a 10-25 token result,
5-50 more), the others answer at once (10-128 tokens): suffixes of ~10 to ~200 tokens after the shared prompt.
DeepSpeed, one rank, `micro_batch_tokens` 8320 (the race's 16 rows of prompt + 128), one optimizer step, glibc's
mmap threshold as `loopline` sets it. Variants, each in its own process (peak RSS is its own), alternated:
  before - every suffix of a micro-batch padded to its longest in one pass, micro-batches counted as padded rows,
           the head (autograd through a checkpointed chunk) on every kept position of every row;
  passes - the suffixes in passes of similar length (trainer/prefix.py `suffix_chunks`), the rest as before;
  now    - also micro-batches counted by what runs (each shared prompt once), and the head on the action
           positions only, its gradient made in place (trainer/head.py).
Prints the median seconds per step (a warm-up step excluded) and the peak RSS of each, and their ratios to before.
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
VARIANTS = ("before", "passes", "now")


def race_batch(vocab: int, seed: int = 0):
    from loopline.trainer.batch import TrainSequence

    rng = random.Random(seed)
    out = []
    for group in range(8):
        prompt = [rng.randrange(vocab) for _ in range(398)]
        for k in range(8):
            if rng.random() < 0.8:  # a tool call, its result, the answer
                first, result, second = rng.randint(20, 70), rng.randint(10, 25), rng.randint(5, 50)
            else:
                first, result, second = rng.randint(10, 128), 0, 0
            mask = [0] * len(prompt) + [1] * first + [0] * result + [1] * second
            ids = prompt + [rng.randrange(vocab) for _ in range(first + result + second)]
            mu = [-rng.random() * 4 if m else 0.0 for m in mask]
            out.append(TrainSequence(None, group, float(k % 2), ids, mask, mu))
    return out


def _before_head(head_module) -> None:
    """The head as it was: autograd through each chunk's logits, made again in backward by activation checkpointing,
    on every position it is given."""
    import torch
    from torch.utils.checkpoint import checkpoint

    def chunk(states, weight, bias, targets, temperature, with_entropy):
        logits = torch.nn.functional.linear(states, weight, bias).float() / temperature
        entropy = head_module.token_entropy(logits) if with_entropy else logits.new_zeros(0)
        return logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1), entropy

    def states_logprobs(states, head, targets, temperature, entropy=None, at=None):
        flat, wanted = states.reshape(-1, states.shape[-1]), targets.reshape(-1)
        picked, entropies = [], []
        for start in range(0, flat.shape[0], head_module.HEAD_CHUNK):
            args = (flat[start : start + head_module.HEAD_CHUNK], head.weight, head.bias, wanted[start : start + head_module.HEAD_CHUNK],
                    temperature, entropy is not None)
            logp, h = checkpoint(chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else chunk(*args)
            picked.append(logp)
            entropies.append(h)
        if entropy is not None:
            entropy.append(torch.cat(entropies).reshape(targets.shape))
        return torch.cat(picked).reshape(targets.shape)

    head_module.states_logprobs = states_logprobs


def child(model: str, variant: str, steps: int) -> None:
    from loopline import allocator

    allocator.tune()  # (before any tensor, as the CLI does)
    from loopline.trainer import head, learner as learner_module, prefix
    from loopline.trainer.learner import Learner, LearnerConfig

    if variant != "now":
        _before_head(head)
        plain = learner_module.micro_batches
        learner_module.micro_batches = lambda sequences, budget, share_prefix=False: plain(sequences, budget)  # type: ignore[assignment]
    if variant == "before":
        prefix.SUFFIX_PASS_OVERHEAD = 10**9  # (one pass: every partition costs more)
    learner = Learner(model, LearnerConfig(lr=1e-6, micro_batch_tokens=8320, backend="deepspeed"))
    batch = race_batch(learner.model.config.vocab_size)
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        learner.rl_step(batch)
        times.append(time.perf_counter() - started)
    print(json.dumps({"variant": variant, "times": times[1:], "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory, e.g. the one `loopline models pull smollm2-135m` writes")
    parser.add_argument("--steps", type=int, default=1, help="timed steps in each process (after a warm-up step)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child, args.steps)
        return
    results: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            done = subprocess.run([sys.executable, "-m", "benchmarks.learner_passes", "--model", args.model, "--steps", str(args.steps),
                                   "--child", variant], cwd=ROOT, capture_output=True, text=True, check=True)
            results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {variant: (statistics.median(t for r in runs for t in r["times"]), max(r["peak_gib"] for r in runs)) for variant, runs in results.items()}
    before_s, before_gib = summary["before"]
    for variant, (seconds, gib) in summary.items():
        print(f"{variant:7s} {seconds:7.1f} s a step ({seconds / before_s:.2f}x)   peak RSS {gib:.2f} GiB ({gib / before_gib:.2f}x)")


if __name__ == "__main__":
    main()
