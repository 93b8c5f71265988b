"""Where a learner step's memory goes, and what the chunked head (trainer/head.py) and the allocator change (issue 66).

    python -m benchmarks.learner_memory --model DIR [--steps 2] [--rounds 1] [--variants ...] [--batch NPZ] [--micro-batch-tokens N] [--categories]

The work: the race's step (benchmarks/race_vs_trl.py) as the learner sees it: 8 groups x 8 samples, a 392-token
prompt shared by a group, then 20-40 action tokens, a 6-10-token tool result and 8-20 action tokens; one optimizer
step, DeepSpeed (one rank), the default learner config. Variants, each in its own process (its peak RSS its own),
alternated so that machine noise hits them alike, the first two with glibc's mmap threshold at 1 MB as `loopline`
sets it (loopline/allocator.py):
  whole    - the LM head's logits at every action position of a micro-batch at once (before issue 66);
  chunked  - the head a chunk of positions at a time, its logits made again in backward (the default);
  whole / chunked, glibc's defaults - the allocator as a plain Python process has it (its threshold rises to
             32 MB, and freed tensors below it stay in malloc's heap, reused without page faults);
  chunked, huge pages - as `chunked`, with torch's THP_MEM_ALLOC_ENABLE (where transparent huge pages are
             `madvise`, as on most distributions: a mapped block faults in 2 MB at a time, not 4 KB).
  chunked, jemalloc - as `chunked`, with jemalloc instead of glibc's malloc (LD_PRELOAD; Debian's libjemalloc2 at its
             defaults: freed pages are kept for reuse and given back after 10 s);
  chunked, rows by length - as `chunked`, micro-batches packed by row length alone, as before issue 66 (now the
             rows that share a prompt stay together: each micro-batch runs a prompt it holds once).
With --batch, the step's sequences are a recorded step's (`--record HOME RUN STEP FILE` writes one from a run's
ledger: `benchmarks/results/race_step.npz` is step 1 of the race's loopline side, seed 0).
Prints each variant's peak RSS (GiB) and median seconds per step, and their ratios to the first run (`whole`). With
--categories, one chunked step runs under torch's memory profiler first and its peak is printed by category
(parameters, optimizer state, gradients, activations, ...), then the ops by what they allocate (the step of --batch and
--micro-batch-tokens where given): what the tensors hold, beside what the process holds.
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
HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1"}  # torch's CPU allocator: blocks of 2 MB and more aligned to, and advised as, huge pages
VARIANTS = {
    "whole": AS_LOOPLINE, "chunked": AS_LOOPLINE, "whole, glibc's defaults": {}, "chunked, glibc's defaults": {},
    "chunked, huge pages": {**AS_LOOPLINE, **HUGE_PAGES},
    "chunked, rows by length": AS_LOOPLINE,
    "chunked, jemalloc": {"LD_PRELOAD": "libjemalloc.so.2"},
}


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


def by_length(sequences, token_budget: int) -> list[list[int]]:
    """Micro-batches as loopline packed them before issue 66: rows sorted by length, filled up to the budget."""
    batches: list[list[int]] = [[]]
    for i in sorted(range(len(sequences)), key=lambda i: len(sequences[i].input_ids)):
        if batches[-1] and max(len(sequences[j].input_ids) for j in batches[-1] + [i]) * (len(batches[-1]) + 1) > token_budget:
            batches.append([])
        batches[-1].append(i)
    return batches


def record(home: str, run: str, step: int, path: str) -> None:
    """A committed learner step's sequences, from a run's ledger (LOOPLINE_HOME `home`), as arrays."""
    import numpy as np

    os.environ["LOOPLINE_HOME"] = home
    os.environ.pop("LOOPLINE_DATABASE_URL", None)
    from loopline.pipeline.stages import load_sequences
    from loopline.store import db, ledger, views

    database = db.make_engine()
    with database.connect() as conn:
        run_id = views.run_id(conn, run)
    with db.session(database) as s:
        sequences = load_sequences(s, ledger.trained_batch(s, run_id, step))  # (in the order it was trained)
    np.savez_compressed(path, **{field: np.concatenate([getattr(q, field) for q in sequences]) for field in ("input_ids", "action_mask", "behaviour_logprobs")},
                        lengths=np.array([len(q.input_ids) for q in sequences]), groups=np.array([str(q.group_id) for q in sequences]),
                        rewards=np.array([q.reward for q in sequences]))


def recorded_batch(path: str):
    import numpy as np

    from loopline.trainer.batch import TrainSequence

    data = np.load(path)
    ends = np.cumsum(data["lengths"])
    cut = lambda field, k: data[field][ends[k] - data["lengths"][k] : ends[k]]  # noqa: E731
    return [TrainSequence(None, str(data["groups"][k]), float(data["rewards"][k]), cut("input_ids", k), cut("action_mask", k), cut("behaviour_logprobs", k))
            for k in range(len(data["lengths"]))]


def child(model: str, variant: str, steps: int, batch_file: str | None, micro_batch_tokens: int | None) -> None:
    from benchmarks.learner_step import timed_steps
    from loopline.trainer import learner as learner_module
    from loopline.trainer.learner import Learner, LearnerConfig

    learner = Learner(model, LearnerConfig(lr=1e-6, **({"micro_batch_tokens": micro_batch_tokens} if micro_batch_tokens else {})))
    if variant.startswith("whole"):
        learner._plain_head = False
    if variant.endswith("rows by length"):
        learner_module.micro_batches = by_length
    batch = recorded_batch(batch_file) if batch_file else race_batch(learner.model.config.vocab_size)
    times, peak_gib = timed_steps(learner, steps, batch)
    print(json.dumps({"variant": variant, "times": times, "peak_gib": peak_gib}))


def categories(model: str, batch_file: str | None = None, micro_batch_tokens: int | None = None) -> None:
    """One chunked step under torch's memory profiler (after a first step made the optimizer's state): the
    tensors' peak, by category."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    from loopline.trainer.learner import Learner, LearnerConfig

    learner = Learner(model, LearnerConfig(lr=1e-6, **({"micro_batch_tokens": micro_batch_tokens} if micro_batch_tokens else {})))
    batch = recorded_batch(batch_file) if batch_file else race_batch(learner.model.config.vocab_size)
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
    held = sorted(profiled.key_averages(), key=lambda e: -e.self_cpu_memory_usage)[:8]
    print("ops by what they allocate over the step (GiB, summed over their calls): "
          + ", ".join(f"{e.key} {e.self_cpu_memory_usage / GIB:.2f}" for e in held))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory, e.g. the one `loopline models pull smollm2-135m` writes")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), help="which to run (the first is the base of the ratios)")
    parser.add_argument("--batch", help="a recorded step's sequences (.npz, see --record) instead of the synthetic race step")
    parser.add_argument("--micro-batch-tokens", type=int, help="the learner's micro_batch_tokens (default: its default)")
    parser.add_argument("--record", nargs=4, metavar=("HOME", "RUN", "STEP", "FILE"), help="write a run's learner step's sequences to FILE and stop")
    parser.add_argument("--categories", action="store_true", help="first, the tensors' peak by category (torch's memory profiler)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record:
        return record(args.record[0], args.record[1], int(args.record[2]), args.record[3])
    if args.child:
        return child(args.model, args.child, args.steps, args.batch, args.micro_batch_tokens)
    if args.categories:
        call = f"categories({args.model!r}, {args.batch!r}, {args.micro_batch_tokens!r})"
        subprocess.run([sys.executable, "-c", f"from benchmarks.learner_memory import categories; {call}"], cwd=ROOT, check=True)
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for _ in range(args.rounds):
        for variant in args.variants:
            env = VARIANTS[variant]
            extra = [*(["--batch", args.batch] if args.batch else []), *(["--micro-batch-tokens", str(args.micro_batch_tokens)] if args.micro_batch_tokens else [])]
            done = subprocess.run([sys.executable, "-m", "benchmarks.learner_memory", "--model", args.model, "--steps", str(args.steps), "--child", variant, *extra],
                                  cwd=ROOT, env={**{k: v for k, v in os.environ.items() if k not in {*AS_LOOPLINE, *HUGE_PAGES, "LD_PRELOAD"}}, **env},
                                  capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {v: (max(r["peak_gib"] for r in rs), statistics.median(t for r in rs for t in r["times"])) for v, rs in runs.items()}
    peak0, time0 = summary[args.variants[0]]
    for variant, (peak, seconds) in summary.items():
        print(f"{variant:26s} peak RSS {peak:5.2f} GiB ({peak / peak0:.2f}x)   step {seconds:6.1f} s ({seconds / time0:.2f}x)")
    print(f"({args.rounds} round(s) of {args.steps} steps a variant; the median step includes the first, which makes the optimizer's state)")


if __name__ == "__main__":
    main()
