"""The coding agent end to end in Docker (issue 17 part 3): sandbox costs, throughput, and a training run.

    python -m benchmarks.coding_run                    # all three parts below, in one run
    python -m benchmarks.coding_run --only sandbox     # a scripted agent: the env's smoke test (writes each task's reference)
    python -m benchmarks.coding_run --only policy      # the quickstart's policy + demonstration on the held-out problems
    python -m benchmarks.coding_run --only train       # `loopline train examples/coding_quickstart.yaml`, read back

sandbox: episodes of the scripted agent at concurrency 4/8/16: trajectories/s, sandbox start, verification
  and teardown p50/p95, the share of an episode spent starting its sandbox, infra failures. It measures
  the sandbox path alone (no model), so it is the ceiling the environment puts on throughput here.
policy: the quickstart's policy (SmolLM2-135M-Instruct with the config's demonstration turns) plays every
  held-out problem greedily at concurrency 4/8/16 with the run's sampling budget: pass rate (all hidden
  tests), mean reward (fraction of tests), how often it wrote solution.py / ran code, trajectories/s,
  sandbox start as a share of the episode, infra failures (retried in a run, never scored 0).
train: the quickstart run; from the ledger: held-out pass rate per evaluated version, the sandbox start /
  verification times of its training episodes, the attempts that failed for infra reasons.
Writes benchmarks/out/coding_run.json. Needs Docker and the image (`envreg image build`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.smollm2_learning import pulled_model

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
ENV = ROOT / "examples" / "coding_env.yaml"
CONFIG = ROOT / "examples" / "coding_quickstart.yaml"
CONCURRENCY = (4, 8, 16)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _times(values: list[float]) -> dict:
    return {"p50": _pct(values, 0.5), "p95": _pct(values, 0.95), "n": len(values)}


def _spec_and_tasks():
    from loopline.envregistry.spec import load_spec
    from loopline.envregistry.tasks import load_tasks

    spec = load_spec(ENV)
    return spec, load_tasks(spec, ENV.parent)


async def _play(items, concurrency: int, play):
    """`play(item)` for every item, at most `concurrency` at once; (results, wall seconds)."""
    slots = asyncio.Semaphore(concurrency)

    async def one(item):
        async with slots:
            return await play(item)

    started = time.monotonic()
    results = await asyncio.gather(*(one(i) for i in items))
    return results, time.monotonic() - started


def sandbox(episodes: int) -> dict:
    from loopline.envregistry.smoke import run_smoke

    spec, tasks = _spec_and_tasks()
    chosen = (tasks * (episodes // len(tasks) + 1))[:episodes]
    out = {}
    print(f"{'conc':>4s} {'traj/s':>7s} {'start p50/p95 s':>16s} {'verify p50/p95 s':>17s} {'close p50 s':>11s} {'start share':>11s} {'infra':>5s} {'wrong':>5s}")
    for concurrency in CONCURRENCY:
        results, wall = asyncio.run(_play(chosen, concurrency, lambda t: run_smoke(spec, t)))
        start = [r.timings["start"] for r in results if "start" in r.timings]
        verify = [r.timings["verify"] for r in results if "verify" in r.timings]
        close = [r.timings["close"] for r in results]
        total = [sum(r.timings.values()) for r in results]
        row = {
            "trajectories_per_s": len(results) / wall, "sandbox_start_s": _times(start), "verify_s": _times(verify),
            "close_s": _times(close), "start_share": sum(start) / sum(total),
            "infra_failures": sum(r.infra_error is not None for r in results),
            "not_reward_1": sum(r.infra_error is None and r.reward != 1.0 for r in results), "episodes": len(results),
        }
        out[str(concurrency)] = row
        print(f"{concurrency:4d} {row['trajectories_per_s']:7.2f} {row['sandbox_start_s']['p50']:7.2f} / {row['sandbox_start_s']['p95']:5.2f} "
              f"{row['verify_s']['p50']:8.2f} / {row['verify_s']['p95']:5.2f} {row['close_s']['p50']:11.2f} "
              f"{row['start_share']:11.1%} {row['infra_failures']:5d} {row['not_reward_1']:5d}", flush=True)
    return out


def policy(tasks_limit: int | None) -> dict:
    from dataclasses import replace

    from loopline.envregistry.sandbox.base import InfraFailure
    from loopline.rollout.harness.chat import ChatFormat
    from loopline.rollout.engines.base import EngineError, SamplingParams
    from loopline.rollout.harness.episode import EpisodeSetup, run_episode
    from loopline.rollout.engines.local import LocalEngine
    from loopline.store.db import loopline_home

    config = yaml.safe_load(CONFIG.read_text())
    model = pulled_model(loopline_home())
    spec, tasks = _spec_and_tasks()
    held_out = [t for t in tasks if t.split == "eval"][:tasks_limit]
    chat = replace(ChatFormat.for_policy(model), few_shot=tuple(config["rollout"]["few_shot"]))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=config["rollout"]["sampling"]["max_new_tokens"], seed=0)
    setup = EpisodeSetup(spec, 0, chat, sampling)  # env_version labels ledger rows: this part writes none
    out = {}
    print(f"{'conc':>4s} {'pass':>6s} {'reward':>6s} {'wrote':>6s} {'ran':>6s} {'tokens':>6s} {'traj/s':>7s} {'start share':>11s} {'infra':>5s} {'s':>5s}")

    async def play_all(concurrency: int):
        engine = LocalEngine(model, max_batch=concurrency)
        infra = []

        async def play(task):
            try:
                return await run_episode(engine, setup, task, f"c{concurrency}-{task.id}/")
            except (EngineError, InfraFailure) as exc:
                infra.append(f"{task.id}: {exc}")
                return None

        try:
            results, wall = await _play(held_out, concurrency, play)
        finally:
            await engine.close()
        return [r for r in results if r is not None], wall, infra

    for concurrency in CONCURRENCY:
        results, wall, infra = asyncio.run(play_all(concurrency))
        events = [[e for s in r.segments for e in (s.tool_events or [])] for r in results]
        start = sum(r.timings["sandbox_start_s"] for r in results)
        row = {
            "pass_rate": statistics.mean(r.reward == 1.0 for r in results),
            "mean_reward": statistics.mean(r.reward for r in results),
            "wrote_solution": statistics.mean(any(e["tool"] in ("write_file", "write_solution") and not e["error"] for e in ev) for ev in events),
            "ran_code": statistics.mean(any(e["tool"] == "run" for e in ev) for ev in events),
            "generated_tokens_mean": statistics.mean(r.info["generated_tokens"] for r in results),
            "trajectories_per_s": len(results) / wall, "wall_s": wall,
            "start_share": start / sum(r.timings["episode_s"] for r in results),
            "sandbox_start_s": _times([r.timings["sandbox_start_s"] for r in results]),
            "verify_s": _times([r.timings["verify_s"] for r in results]),
            "infra_failures": len(infra), "infra": infra[:5], "episodes": len(held_out),
        }
        out[str(concurrency)] = row
        print(f"{concurrency:4d} {row['pass_rate']:6.1%} {row['mean_reward']:6.2f} {row['wrote_solution']:6.1%} {row['ran_code']:6.1%} "
              f"{row['generated_tokens_mean']:6.0f} {row['trajectories_per_s']:7.3f} {row['start_share']:11.1%} {len(infra):5d} {wall:5.0f}", flush=True)
    return out


def train(steps: int | None, eval_every: int | None, lr: float | None = None) -> dict:
    from loopline.store import views
    from loopline.store.db import read_only_engine

    config = yaml.safe_load(CONFIG.read_text())
    config["name"] = f"coding-quickstart-{int(time.time())}"
    config["steps"] = steps or config["steps"]
    config["eval"]["every"] = eval_every or config["eval"]["every"]
    config["learner"]["lr"] = lr or config["learner"]["lr"]
    config["env"] = str(ENV)
    work = Path(tempfile.mkdtemp(prefix="coding-run-"))
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "loopline.cli", "train", str(work / "run.yaml")], cwd=ROOT, check=True)
    wall = time.monotonic() - started
    database = read_only_engine()
    with database.connect() as conn:
        run = views.run_id(conn, config["name"])
        evals = views.evals(conn, run)
        episodes = views.episode_timings(conn, run)
        classes = views.failure_classes(conn, run)
        metrics = views.metrics(conn, run)
    database.dispose()
    curve = [dict(zip(evals.columns, r)) for r in evals.rows]
    rows = [dict(zip(episodes.columns, r)) for r in episodes.rows]
    attempts: dict[str, int] = {}
    for _, klass, n in classes.rows:
        attempts[klass] = attempts.get(klass, 0) + n
    reward = {int(step): value for step, metric, value in metrics.rows if metric == "reward_mean"}
    result = {
        "run": config["name"], "lr": config["learner"]["lr"], "steps": config["steps"], "wall_s": wall, "held_out_pass_rate": {c["policy_version"]: c["success_rate"] for c in curve},
        "held_out_mean_reward": {c["policy_version"]: c["mean_reward"] for c in curve},
        "training_reward_mean": reward, "attempts": attempts,
        "infra_failure_rate": attempts.get("infra_failed", 0) / max(1, sum(attempts.values())),
        "sandbox_start_s": _times([r["sandbox_start_s"] for r in rows if r["sandbox_start_s"] is not None]),
        "verify_s": _times([r["verify_s"] for r in rows]), "episode_s": _times([r["episode_s"] for r in rows]),
    }
    first, last = curve[0]["success_rate"], curve[-1]["success_rate"]
    print(f"held-out pass rate {first:.1%} (v{curve[0]['policy_version']}) -> {last:.1%} (v{curve[-1]['policy_version']}) in {wall / 60:.1f} min; "
          f"mean reward (fraction of hidden tests) {' -> '.join(format(c['mean_reward'], '.3f') for c in curve)}")
    print(f"training reward by step: {', '.join(f'{k}: {v:.2f}' for k, v in sorted(reward.items()))}")
    print(f"attempts: {attempts} (infra-failure rate {result['infra_failure_rate']:.1%}); sandbox start p50 "
          f"{result['sandbox_start_s']['p50']:.2f} s, p95 {result['sandbox_start_s']['p95']:.2f} s; verification p50 "
          f"{result['verify_s']['p50']:.2f} s; episode p50 {result['episode_s']['p50']:.1f} s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["sandbox", "policy", "train"])
    parser.add_argument("--episodes", type=int, default=64, help="sandbox: scripted episodes per concurrency")
    parser.add_argument("--tasks", type=int, default=None, help="policy: the first N held-out problems (default all 58)")
    parser.add_argument("--steps", type=int, default=None, help="train: learner steps (default the quickstart's)")
    parser.add_argument("--eval-every", type=int, default=None, help="train: evaluate every N steps (default the quickstart's)")
    parser.add_argument("--lr", type=float, default=None, help="train: learning rate (default the quickstart's)")
    args = parser.parse_args()
    result = {}
    if args.only in (None, "sandbox"):
        print("== sandbox: scripted agent (writes the reference solution, runs it, answers) ==")
        result["sandbox"] = sandbox(args.episodes)
    if args.only in (None, "policy"):
        print("== policy: SmolLM2-135M-Instruct + the quickstart's demonstration, greedy, held-out problems ==")
        result["policy"] = policy(args.tasks)
    if args.only in (None, "train"):
        print("== train: loopline train examples/coding_quickstart.yaml ==")
        result["train"] = train(args.steps, args.eval_every, args.lr)
    OUT.mkdir(parents=True, exist_ok=True)
    name = "coding_run.json" if args.only is None else f"coding_run_{args.only}.json"
    (OUT / name).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
