"""Startup cost of `loopline train` on resume: where the seconds before any work go, and what the early server saves.

    python -m benchmarks.startup [--repeats 3]

Resumes a finished 1-step run (nothing left to do, so the wall time is startup and shutdown alone) and
measures the seconds from launch to its first ledger write (the run marked `running` again) and to the
process's exit, alternating two variants in one run so that machine noise hits both alike:
  prefect  - Prefect starts its temporary API server when the first flow runs (LOOPLINE_TEMP_SERVER=prefect;
             what loopline did before issue 12),
  loopline - loopline starts it first, so it boots while torch, transformers and DeepSpeed import.
Also prints the parts measured alone: importing the train flow's modules, and a temporary server's boot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _timed(argv: list[str], env: dict) -> float:
    return _resume(argv, env)[1]


def _resume(argv: list[str], env: dict, engine=None, run: str | None = None) -> tuple[float | None, float]:
    """(seconds to the run's status turning `running`, seconds to exit); the first is polled from the ledger."""
    import sqlalchemy as sa

    start = time.monotonic()
    first_write = None
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if engine is not None and first_write is None:
                with engine.connect() as conn:
                    status = conn.execute(sa.text("SELECT status FROM run WHERE name = :n"), {"n": run}).scalar()
                if status == "running":
                    first_write = time.monotonic() - start
            time.sleep(0.05)
        if proc.returncode != 0:
            out.seek(0)
            raise SystemExit(f"{' '.join(argv)} failed:\n{out.read().decode(errors='replace')[-3000:]}")
    return first_write, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="resumes per variant")
    args = parser.parse_args()

    from benchmarks._scratch import scratch_database
    from loopline.trainer.tiny import build_tiny

    with scratch_database() as (url, engine), tempfile.TemporaryDirectory() as tmp:
        policy = build_tiny(Path(tmp) / "policy", seed=0)
        config = Path(tmp) / "run.yaml"
        config.write_text(yaml.safe_dump({
            "name": "startup-bench", "env": str(ROOT / "examples" / "arithmetic_env.yaml"), "policy": str(policy),
            "steps": 1, "rollout": {"groups_per_step": 1, "group_size": 2, "concurrency": 2, "sampling": {"max_new_tokens": 8}},
            "learner": {"backend": "deepspeed"}, "eval": {"every": 1, "tasks": 2},
        }))
        env = {**os.environ, "LOOPLINE_DATABASE_URL": url, "LOOPLINE_HOME": str(Path(tmp) / "home"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        train = [sys.executable, "-m", "loopline.cli", "train", str(config)]
        print(f"first run (trains its one step): {_timed(train, env):.1f} s")
        times: dict[str, list[tuple[float, float]]] = {"prefect": [], "loopline": []}
        for _ in range(args.repeats):
            for variant in times:
                times[variant].append(_resume(train, {**env, "LOOPLINE_TEMP_SERVER": variant}, engine, "startup-bench"))
        imports = [_timed([sys.executable, "-c", "import loopline.flows.train"], env) for _ in range(args.repeats)]
        boot = [
            _timed([sys.executable, "-c", "from pathlib import Path; from loopline.orchestration.server import TemporaryServer; "
                    f"TemporaryServer(Path({tmp!r}) / 'logs').wait()"], env)
            for _ in range(args.repeats)
        ]
    print(f"resume of a finished run, median of {args.repeats} (first ledger write / exit):")
    medians = {}
    for variant, label in (("prefect", "Prefect's temporary server"), ("loopline", "loopline's early server")):
        writes, exits = [w for w, _ in times[variant]], [e for _, e in times[variant]]
        medians[variant] = statistics.median(writes), statistics.median(exits)
        print(f"  {label:28s} {medians[variant][0]:5.1f} s / {medians[variant][1]:5.1f} s   "
              f"(each: {', '.join(f'{w:.1f}/{e:.1f}' for w, e in times[variant])})")
    (w0, e0), (w1, e1) = medians["prefect"], medians["loopline"]
    print(f"  loopline / prefect: first write {w1 / w0:.2f}, exit {e1 / e0:.2f}")
    print(f"parts alone: import of the train flow's modules {statistics.median(imports):.1f} s, "
          f"temporary server boot (incl. interpreter start) {statistics.median(boot):.1f} s")


if __name__ == "__main__":
    main()
