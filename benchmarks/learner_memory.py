"""Where a learner step's memory goes, and what the chunked head (trainer/head.py) and the allocator change (issue 66).

    python -m benchmarks.learner_memory --model DIR [--steps 2] [--rounds 1] [--categories]

The work: the race's step (benchmarks/race_vs_trl.py) as the learner sees it: 8 groups x 8 samples, a 392-token
prompt shared by a group, then 20-40 action tokens, a 6-10-token tool result and 8-20 action tokens; one optimizer
step, DeepSpeed (one rank), the default learner config. Variants, each in its own process (its peak RSS its own),
alternated so that machine noise hits them alike, the first two with glibc's mmap threshold at 1 MB as `loopline`
sets it (loopline/allocator.py):
  whole    - the LM head's logits at every action position of a micro-batch at once (before issue 66);
  chunked  - the head a chunk of positions at a time, its logits made again in backward (the default);
  whole / chunked, glibc's defaults - the allocator as a plain Python process has it (its threshold rises to
             32 MB, and freed tensors below it stay in malloc's heap, reused without page faults).
Prints each variant's peak RSS (GiB) and median seconds per step, and their ratios to `whole`. With
--categories, one chunked step runs under torch's memory profiler first and its peak is printed by category
(parameters, optimizer state, gradients, activations, ...): what the tensors hold, beside what the process holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
AS_LOOPLINE = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}  # what `loopline` sets for itself and its children (loopline/allocator.py)
VARIANTS = {"whole": AS_LOOPLINE, "chunked": AS_LOOPLINE, "whole, glibc's defaults": {}, "chunked, glibc's defaults": {}}


def race_batch(vocab: int, seed: int = 0, prompt_tokens: int = 392):
    from loopline.trainer.batch import TrainSequence

    rng = random.Random(seed)
    out = []
    for group in range(8):
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for k in range(8):
            ids, mask, mu = list(prompt), [0] * prompt_tokens, [0.0] * prompt_tokens
            for (low, high), action in (((20, 40), 1), ((6, 10), 0), ((8, 20), 1)):
                n = rng.randint(low, high)
                ids += [rng.randrange(vocab) for _ in range(n)]
                mask += [action] * n
                mu += [-rng.random() * 4 if action else 0.0 for _ in range(n)]
            out.append(TrainSequence(None, group, float(k % 2), tuple(ids), tuple(mask), tuple(mu)))
    return out


def child(model: str, variant: str, steps: int) -> None:
    from benchmarks.learner_step import timed_steps
    from loopline.trainer.learner import Learner, LearnerConfig

    learner = Learner(model, LearnerConfig(lr=1e-6))
    if variant.startswith("whole"):
        learner._plain_head = False
    times, peak_gib = timed_steps(learner, steps, race_batch(learner.model.config.vocab_size))
    print(json.dumps({"variant": variant, "times": times, "peak_gib": peak_gib}))


def categories(model: str) -> None:
    """One chunked step under torch's memory profiler (after a first step made the optimizer's state): the
    tensors' peak, by category."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    from loopline.trainer.learner import Learner, LearnerConfig

    learner = Learner(model, LearnerConfig(lr=1e-6))
    batch = race_batch(learner.model.config.vocab_size)
    learner.rl_step(batch)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as profiled:
        learner.rl_step(batch)
    path = Path(tempfile.mkdtemp()) / "timeline.json"
    profiled.export_memory_timeline(str(path), device="cpu")
    _, sizes = json.loads(path.read_text())
    names = ["?"] * (len(_CATEGORY_TO_INDEX) + 1)
    for category, index in _CATEGORY_TO_INDEX.items():
        names[index + 1] = category.name.lower() if category else "unknown"
    peak = max(sizes, key=sum)
    print(f"tensors at the step's peak: {sum(peak) / GIB:.2f} GiB = "
          + ", ".join(f"{name} {size / GIB:.2f}" for name, size in sorted(zip(names, peak), key=lambda x: -x[1]) if size >= 0.005 * GIB))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory, e.g. the one `loopline models pull smollm2-135m` writes")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--categories", action="store_true", help="first, the tensors' peak by category (torch's memory profiler)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.model, args.child, args.steps)
    if args.categories:
        subprocess.run([sys.executable, "-c", f"from benchmarks.learner_memory import categories; categories({args.model!r})"], cwd=ROOT, check=True)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant, env in VARIANTS.items():
            done = subprocess.run([sys.executable, "-m", "benchmarks.learner_memory", "--model", args.model, "--steps", str(args.steps), "--child", variant],
                                  cwd=ROOT, env={**{k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}, **env},
                                  capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {v: (max(r["peak_gib"] for r in rs), statistics.median(t for r in rs for t in r["times"])) for v, rs in runs.items()}
    peak0, time0 = summary["whole"]
    for variant, (peak, seconds) in summary.items():
        print(f"{variant:26s} peak RSS {peak:5.2f} GiB ({peak / peak0:.2f}x)   step {seconds:6.1f} s ({seconds / time0:.2f}x)")
    print(f"({args.rounds} round(s) of {args.steps} steps a variant; the median step includes the first, which makes the optimizer's state)")


if __name__ == "__main__":
    main()
