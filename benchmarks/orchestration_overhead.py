"""Orchestration overhead: one quickstart step through Prefect tasks vs the same stage functions called directly.

    python -m benchmarks.orchestration_overhead [--steps 8] [--policy DIR]

Both kinds of step run in one flow run of one process on one run of the ledger, interleaved
(direct, Prefect, direct, ...) so that machine noise and the policy's drift hit both alike. Prints
the median wall time of each and their ratio (the issue's bar: Prefect / direct <= 1.05).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps in all (half of each kind)")
    parser.add_argument("--policy", default="tiny", help="tiny (built once), or a model directory")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    from benchmarks._scratch import scratch_database

    with scratch_database() as (url, _), tempfile.TemporaryDirectory() as tmp:
        os.environ["LOOPLINE_DATABASE_URL"] = url
        config = yaml.safe_load((ROOT / "examples" / "arithmetic_quickstart.yaml").read_text())
        config.update(name="overhead-bench", env=str(ROOT / "examples" / "arithmetic_env.yaml"), policy=args.policy, steps=args.steps)
        path = Path(tmp) / "run.yaml"
        path.write_text(yaml.safe_dump(config))
        direct, prefect = measure(str(path), args.steps)
    print(f"steps of each kind: {len(direct)} (quickstart: {config['rollout']['groups_per_step']} groups x {config['rollout']['group_size']})")
    print(f"direct  median {statistics.median(direct):.2f} s  ({', '.join(f'{t:.2f}' for t in direct)})")
    print(f"prefect median {statistics.median(prefect):.2f} s  ({', '.join(f'{t:.2f}' for t in prefect)})")
    print(f"ratio prefect / direct = {statistics.median(prefect) / statistics.median(direct):.3f}")


def measure(config_path: str, steps: int) -> tuple[list[float], list[float]]:
    from prefect import flow
    from prefect.utilities.annotations import quote

    from loopline.pipeline.assembly import run_config
    from loopline.pipeline.opening import prepare
    from loopline.tasks import loop as tasks
    from loopline.pipeline import stages

    @flow(name="orchestration-overhead")
    def bench() -> tuple[list[float], list[float]]:
        p = prepare(*run_config(config_path, None))
        ctx = p.ctx
        live = quote(ctx)  # as the train flow passes it
        timings: tuple[list[float], list[float]] = ([], [])
        try:
            for step in range(1, steps + 1):
                started = time.perf_counter()
                if step % 2:  # the plain functions the tasks wrap
                    stages.plan(ctx, step)
                    asyncio.run(stages.rollout(ctx, step))
                    stages.wait_for_groups(ctx, step)
                    stages.learn(ctx, step)
                    asyncio.run(stages.sync_weights(ctx))
                else:  # the same stages as Prefect task runs, as the train flow calls them
                    tasks.plan_step(live, step)
                    tasks.rollout_batch(live, step)
                    tasks.learner_step(live, step)
                    tasks.sync_weights(live)
                timings[step % 2 == 0].append(time.perf_counter() - started)
        finally:
            ctx.engine.shutdown()
        return timings

    return bench()


if __name__ == "__main__":
    main()
