"""LoRA vs full fine-tuning, one learner step on the same batch, side by side: time, memory, bytes on disk.

    python -m benchmarks.lora_vs_full [--model DIR] [--rank 16] [--steps 4] [--rounds 2] [--backend deepspeed]
    python -m benchmarks.lora_vs_full --curve [--minutes 45] [--rank 16] [--lora-lr 3e-5]

--curve: the learning curve for the same wall-clock. Two `loopline train` runs of
examples/smollm2_arithmetic.yaml start together, one thread each (so the machine's noise and its memory
bandwidth are shared alike), full fine-tuning at the example's lr and LoRA at --lora-lr (10x: the LoRA
optimum sits about an order of magnitude above full fine-tuning's, as in Thinking Machines' "LoRA Without
Regret"), both evaluated on the same 100 held-out problems every 3 steps; after --minutes both get Ctrl-C
(a run stops cleanly and stays resumable) and the ledger's evaluations are printed side by side.

The work is `benchmarks.learner_step`'s (64 sequences: 8 prompts x 8 samples, 49-token prompts, 26-32
generated tokens, one optimizer step). Variants, each in its own process (peak RSS is its own), alternated
so machine noise hits both alike: full (every weight) and lora (rank R on all-linear, alpha 16). Per
variant: median seconds per step (first excluded), peak RSS, a checkpoint's bytes, an export's bytes (the
merged model either way: what a weight sync through disk ships today), the adapter's own bytes (what a
sync that shipped only the adapter would), and the seconds to hand the in-process engine its weights
(`state_dict`, with LoRA a merge) and to hash them (the sha256 every commit records).
Default model: SmolLM2-135M-Instruct, pulled into LOOPLINE_HOME if missing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def child(model: str, variant: str, rank: int, steps: int, backend: str) -> None:
    from loopline.trainer.config import LoraConfig
    from benchmarks.learner_step import timed_steps
    from loopline.trainer.learner import Learner, LearnerConfig

    lora = LoraConfig(rank=rank) if variant == "lora" else None
    learner = Learner(model, LearnerConfig(lr=1e-5, micro_batch_tokens=16384, lora=lora), backend=backend)
    times, peak_gb = timed_steps(learner, steps)
    started = time.perf_counter()
    learner.state_dict()
    sync_s = time.perf_counter() - started
    started = time.perf_counter()
    learner.weights_sha256()
    sha_s = time.perf_counter() - started
    trained = sum(p.numel() for p in learner.model.parameters() if p.requires_grad)
    with tempfile.TemporaryDirectory() as tmp:
        learner.save_checkpoint(Path(tmp) / "ckpt", policy_version=steps)
        learner.export_weights(Path(tmp) / "export")
        checkpoint_bytes, export_bytes = _bytes(Path(tmp) / "ckpt"), _bytes(Path(tmp) / "export")
    print(json.dumps({
        "variant": variant, "times": times, "peak_gb": peak_gb, "trained_params": trained, "checkpoint_bytes": checkpoint_bytes,
        "export_bytes": export_bytes, "adapter_bytes": 4 * trained if lora else export_bytes, "state_dict_s": sync_s, "sha256_s": sha_s,
    }))


def curve(minutes: float, rank: int, lora_lr: float) -> None:
    import signal

    import yaml

    from loopline.store import views
    from loopline.store.db import read_only_engine

    base = yaml.safe_load((ROOT / "examples" / "smollm2_arithmetic.yaml").read_text())
    base.update(steps=1000, eval={"every": 3, "tasks": 100, "temperature": 0.0})
    stamp = int(time.time())
    work = Path(tempfile.mkdtemp(prefix="lora-curve-"))
    (work / "arithmetic_env.yaml").write_text((ROOT / "examples" / "arithmetic_env.yaml").read_text())
    variants = {
        "full": {**base, "name": f"curve-full-{stamp}"},
        "lora": {**base, "name": f"curve-lora-{stamp}", "learner": {**base["learner"], "lr": lora_lr, "lora": {"rank": rank}}},
    }
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = {}
    for variant, config in variants.items():
        (work / f"{variant}.yaml").write_text(yaml.safe_dump(config))
        log = open(work / f"{variant}.log", "w")
        # Ctrl-C reaches them even when this benchmark runs in the background (`&` makes a shell ignore SIGINT
        # in what it starts, and Python then never installs its handler)
        procs[variant] = subprocess.Popen([sys.executable, "-m", "loopline.cli", "train", str(work / f"{variant}.yaml")], cwd=ROOT,
                                          env=one_thread, stdout=log, stderr=subprocess.STDOUT,
                                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    print(f"logs in {work}; stopping both after {minutes:g} min", flush=True)
    deadline = time.monotonic() + 60 * minutes
    while time.monotonic() < deadline and all(p.poll() is None for p in procs.values()):
        time.sleep(5)
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs.values():
        p.wait(timeout=600)
    database = read_only_engine()
    with database.connect() as conn:
        curves = {v: views.evals(conn, views.run_id(conn, c["name"])) for v, c in variants.items()}
        steps = {v: views.step_timings(conn, views.run_id(conn, c["name"])) for v, c in variants.items()}
    database.dispose()
    print(f"SmolLM2-135M arithmetic, one thread each, side by side for {minutes:g} min; full lr {base['learner']['lr']:g}, "
          f"lora rank {rank} lr {lora_lr:g}; held-out greedy success on 100 problems")
    for variant, table in curves.items():
        rows = [dict(zip(table.columns, r)) for r in table.rows]
        timed = [dict(zip(steps[variant].columns, r)) for r in steps[variant].rows]
        def median(part: str) -> float:
            values = [t[part] for t in timed if t.get(part) is not None]
            return statistics.median(values) if values else float("nan")

        points = ", ".join(f"v{r['policy_version']} {100 * r['success_rate']:.0f}% @ {r['seconds'] / 60:.1f} min" for r in rows)
        print(f"{variant:4s}: {len(timed)} steps (median rollout {median('rollout_s'):.0f} s, learner {median('learner_s'):.0f} s, "
              f"weight sync {median('sync_s'):.2f} s); held-out: {points}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: SmolLM2-135M-Instruct, pulled if missing)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="deepspeed", choices=["deepspeed", "torch"])
    parser.add_argument("--curve", action="store_true", help="learning curves for the same wall-clock (two training runs side by side)")
    parser.add_argument("--minutes", type=float, default=45.0)
    parser.add_argument("--lora-lr", type=float, default=3e-5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.curve:
        curve(args.minutes, args.rank, args.lora_lr)
        return
    if args.model is None:
        from benchmarks.smollm2_learning import pulled_model
        from loopline.store.db import loopline_home

        args.model = str(pulled_model(loopline_home()))
    if args.child:
        child(args.model, args.child, args.rank, args.steps, args.backend)
        return
    results: dict[str, list[dict]] = {"full": [], "lora": []}
    for _ in range(args.rounds):
        for variant in results:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.lora_vs_full", "--model", args.model, "--rank", str(args.rank), "--steps", str(args.steps),
                 "--backend", args.backend, "--child", variant],
                cwd=ROOT, capture_output=True, text=True,
            )
            if done.returncode:
                sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
            results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {}
    mib = 1024**2
    for variant, runs in results.items():
        times = [t for r in runs for t in r["times"][1:]]
        last = runs[-1]
        summary[variant] = {
            "step_s": statistics.median(times), "peak_gb": max(r["peak_gb"] for r in runs), "checkpoint_bytes": last["checkpoint_bytes"],
            "adapter_bytes": last["adapter_bytes"], "state_dict_s": statistics.median(r["state_dict_s"] for r in runs),
            "sha256_s": statistics.median(r["sha256_s"] for r in runs),
        }
        s = summary[variant]
        print(
            f"{variant:4s}: {s['step_s']:6.2f} s per step (median of {len(times)}), peak RSS {s['peak_gb']:.2f} GB, "
            f"{last['trained_params'] / 1e6:.2f}M trained, checkpoint {s['checkpoint_bytes'] / mib:.1f} MiB, "
            f"export {last['export_bytes'] / mib:.1f} MiB, adapter {s['adapter_bytes'] / mib:.1f} MiB, "
            f"engine weights {s['state_dict_s']:.3f} s, sha256 {s['sha256_s']:.2f} s"
        )
    full, lora = summary["full"], summary["lora"]
    print(
        f"lora / full: step time {lora['step_s'] / full['step_s']:.2f}, peak memory {lora['peak_gb'] / full['peak_gb']:.2f}, "
        f"checkpoint bytes {lora['checkpoint_bytes'] / full['checkpoint_bytes']:.3f}, adapter / full weights {lora['adapter_bytes'] / full['adapter_bytes']:.3f}"
    )


if __name__ == "__main__":
    main()
