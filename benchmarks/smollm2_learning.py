"""SmolLM2-135M-Instruct learning the arithmetic env's calculator (issue 17 part 2): prompts first, then RL.

    python -m benchmarks.smollm2_learning --probe [--tasks 100]     # held-out success of candidate few-shot prompts, before any training
    python -m benchmarks.smollm2_learning [--mode sync|async]       # train examples/smollm2_arithmetic.yaml, write the curve and numbers
    python -m benchmarks.smollm2_learning --report RUN              # the same numbers for a run already in the ledger

--probe plays the env's held-out problems with the pulled model under each candidate demonstration
(greedy, as the run's evaluation does, and T=1 on 4 samples, the training signal) and prints success,
calculator use and answer-format rates: the demonstration matters more than any RL setting.
The training run is `loopline train` on the example config (with --mode); afterwards it reads the
ledger: held-out success per version, the per-step time breakdown (generation, learner, checkpoint,
export, weight sync), and writes benchmarks/out/smollm2_learning_<mode>.png and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loopline.policies.starter import SMOLLM2_FEW_SHOT

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"

# Candidate demonstrations, as chat turns before every task (the observation turn is the env's, as user).
CANDIDATES = {
    "one-calc": [  # shipped before this benchmark
        {"role": "user", "content": "What is 12 + 7 * 3?"},
        {"role": "assistant", "content": "<calc>12 + 7 * 3</calc>"},
        {"role": "user", "content": "<result>33</result>"},
        {"role": "assistant", "content": "<answer>33</answer>"},
    ],
    "two-calc": list(SMOLLM2_FEW_SHOT),  # shipped since this benchmark
    "direct": [
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "<answer>7</answer>"},
        {"role": "user", "content": "What is 10 - 2?"},
        {"role": "assistant", "content": "<answer>8</answer>"},
    ],
}


def pulled_model(home: Path) -> Path:
    model = home / "models" / "smollm2-135m"
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "loopline.cli", "models", "pull", "smollm2-135m"], env={**os.environ, "LOOPLINE_HOME": str(home)}, check=True)
    return model


def probe(model: Path, tasks: int) -> None:
    from loopline.envregistry.spec import load_spec
    from loopline.envregistry.tasks import load_tasks
    from loopline.rollout.harness.chat import ChatFormat
    from loopline.rollout.engines.base import SamplingParams
    from loopline.rollout.harness.episode import EpisodeSetup, run_episode
    from loopline.rollout.engines.local import LocalEngine

    env = ROOT / "examples" / "arithmetic_env.yaml"
    spec = load_spec(env)
    held_out = [t for t in load_tasks(spec, env.parent) if t.split == "eval"][:tasks]
    print(f"{'prompt':10s} {'greedy':>8s} {'T=1 x4':>8s} {'calls calc':>11s} {'answers':>8s} {'s':>6s}")

    async def play_all() -> None:
        engine = LocalEngine(model)  # one engine on one event loop for every candidate
        slots = asyncio.Semaphore(32)  # as the run's concurrency: a queued episode's wall-time budget is running

        async def episode(setup, task, request_id):
            async with slots:
                return await run_episode(engine, setup, task, request_id)
        for name, turns in CANDIDATES.items():
            chat = dataclasses.replace(ChatFormat.for_policy(model), few_shot=tuple(turns))
            results = {}
            started = time.monotonic()
            for label, temperature, samples in (("greedy", 0.0, 1), ("sampled", 1.0, 4)):
                setup = EpisodeSetup(spec, 1, chat, SamplingParams(temperature=temperature, max_new_tokens=48, seed=0))
                results[label] = await asyncio.gather(
                    *(episode(setup, t, f"{name}-{label}-{t.id}-{k}/") for t in held_out for k in range(samples))
                )
            sampled = results["sampled"]
            calc = sum(any(e.get("tool") == "calc" for s in r.segments for e in (s.tool_events or [])) for r in sampled) / len(sampled)
            answered = sum("<answer>" in chat.decode(list(r.segments[-1].generated_ids)) for r in sampled) / len(sampled)
            greedy = statistics.mean(r.reward == 1.0 for r in results["greedy"])
            t1 = statistics.mean(r.reward == 1.0 for r in sampled)
            print(f"{name:10s} {greedy:8.1%} {t1:8.1%} {calc:11.1%} {answered:8.1%} {time.monotonic() - started:6.0f}", flush=True)
        await engine.close()

    asyncio.run(play_all())


def train(mode: str) -> None:
    import yaml

    config = yaml.safe_load((ROOT / "examples" / "smollm2_arithmetic.yaml").read_text())
    config["rollout"]["mode"] = mode
    config["name"] = f"smollm2-arith-{mode}-{int(time.time())}"
    work = Path(tempfile.mkdtemp(prefix="smollm2-"))
    shutil.copy(ROOT / "examples" / "arithmetic_env.yaml", work / "arithmetic_env.yaml")
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "loopline.cli", "train", str(work / "run.yaml")], cwd=ROOT, check=True)
    report(config["name"], mode, time.monotonic() - started)


def report(name: str, mode: str, wall: float | None = None) -> None:
    """The run's curve and per-step time breakdown from the ledger (also for a run stopped early)."""
    from loopline.store import views
    from loopline.store.db import read_only_engine

    database = read_only_engine()
    with database.connect() as conn:
        run = views.run_id(conn, name)
        evals = views.evals(conn, run)
        timings = views.step_timings(conn, run)
        metrics = views.metrics(conn, run)
    database.dispose()
    wanted = ("reward_mean", "clip_fraction", "degenerate_groups", "logprob_abs_diff")
    per_step: dict[int, dict] = {}
    for step, metric, value in metrics.rows:
        if metric in wanted:
            per_step.setdefault(int(step), {})[metric] = value
    curve = [dict(zip(evals.columns, r)) for r in evals.rows]
    steps = [dict(zip(timings.columns, r)) for r in timings.rows]
    parts = [c for c in timings.columns if c.endswith("_s")]
    breakdown = {p: statistics.median(s[p] for s in steps if s.get(p) is not None) for p in parts if any(s.get(p) is not None for s in steps)}
    first, last = curve[0]["success_rate"], curve[-1]["success_rate"]
    wall = wall if wall is not None else curve[-1]["seconds"]
    training = [{"step": k, **v} for k, v in sorted(per_step.items())]
    result = {
        "run": name, "mode": mode, "wall_s": wall, "curve": curve, "training": training,
        "median_step_breakdown_s": breakdown, "gain_points": 100 * (last - first),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"smollm2_learning_{mode}.json").write_text(json.dumps(result, indent=2, default=str))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, right) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot([c["seconds"] / 60 for c in curve], [100 * c["success_rate"] for c in curve], marker="o")
    ax.set_xlabel("minutes")
    ax.set_ylabel("held-out success, greedy (%)")
    ax.set_title(f"SmolLM2-135M, arithmetic with a calculator ({mode})")
    right.plot([t["step"] for t in training], [100 * t.get("reward_mean", float("nan")) for t in training], marker=".")
    right.set_xlabel("learner step")
    right.set_ylabel("training reward, T=1 samples (%)")
    fig.savefig(OUT / f"smollm2_learning_{mode}.png", dpi=100, bbox_inches="tight")
    print(json.dumps(result, indent=2, default=str))
    print(f"held-out success {first:.1%} -> {last:.1%} ({result['gain_points']:+.1f} points) in {wall / 60:.1f} min")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--mode", default="sync", choices=["sync", "async"])
    parser.add_argument("--report", metavar="RUN", help="only read RUN's curve and timings from the ledger (e.g. a run stopped early)")
    args = parser.parse_args()
    from loopline.store.db import loopline_home

    if args.probe:
        probe(pulled_model(loopline_home()), args.tasks)
    elif args.report:
        report(args.report, args.mode)
    else:
        train(args.mode)


if __name__ == "__main__":
    main()
