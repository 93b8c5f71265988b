"""Experiment 3 (seed §10.3): policy lag. Sync vs async with max_staleness 1, 2, 4 on the quickstart.

    python -m benchmarks.policy_lag [--steps 16] [--out benchmarks/out]

Each setting trains the same quickstart config from the same starter policy on a scratch ledger,
one after another in this process. Written to --out: policy_lag.png (held-out success against
wall-clock and against trained tokens, one line per setting) and policy_lag_versions.png (the
version-lag distribution of the trained samples per setting); a table is printed.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa
import yaml

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = [("sync", 0), ("async", 1), ("async", 2), ("async", 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--policy", default="tiny", help="tiny (built once), or a model directory")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    from benchmarks._scratch import scratch_database
    from loopline.flows.train import train

    results = {}
    with scratch_database() as (url, engine), tempfile.TemporaryDirectory() as tmp:
        os.environ["LOOPLINE_DATABASE_URL"] = url
        base = yaml.safe_load((ROOT / "examples" / "arithmetic_quickstart.yaml").read_text())
        for mode, staleness in SETTINGS:
            label = "sync" if mode == "sync" else f"async s={staleness}"
            config = {
                **base, "name": f"lag-{mode}-{staleness}", "env": str(ROOT / "examples" / "arithmetic_env.yaml"),
                "policy": args.policy, "steps": args.steps, "rollout": {**base["rollout"], "mode": mode, "max_staleness": staleness},
                "eval": {**base.get("eval", {}), "every": args.eval_every},
            }
            path = Path(tmp) / f"{config['name']}.yaml"
            path.write_text(yaml.safe_dump(config))
            started = time.time()
            summary = train(str(path))
            results[label] = _collect(engine, summary["run_id"])
            print(f"{label}: {time.time() - started:.0f} s, eval {[f'{s:.0%}' for _, s in summary['eval']]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    _plot(results, args.out)
    print(f"{'setting':<12} {'wall s':>7} {'tokens':>9} {'eval first':>10} {'eval last':>9} {'lag mean':>8} {'lag max':>7}")
    for label, r in results.items():
        lags = r["lags"]
        print(
            f"{label:<12} {r['wall']:>7.0f} {r['tokens'][-1]:>9.0f} {r['evals'][0][2]:>10.1%} {r['evals'][-1][2]:>9.1%} "
            f"{sum(lags) / len(lags):>8.2f} {max(lags):>7d}"
        )
    print(f"plots in {args.out}/policy_lag.png and {args.out}/policy_lag_versions.png")


def _collect(engine: sa.Engine, run_id: str) -> dict:
    """Times count from the run's creation (after the policy is loaded and Prefect is up)."""
    with engine.connect() as conn:
        evals = conn.execute(
            sa.text(
                "SELECT e.policy_version, extract(epoch FROM e.created_at - r.created_at), e.success_rate, "
                "coalesce((SELECT sum(m.value) FROM metric m WHERE m.run_id = e.run_id AND m.name = 'tokens_trained' "
                "          AND m.step <= e.policy_version), 0) "
                "FROM eval_result e JOIN run r ON r.id = e.run_id WHERE e.run_id = :r ORDER BY e.policy_version"
            ),
            {"r": run_id},
        ).all()
        lags = conn.execute(sa.text("SELECT version_lag FROM consumption WHERE run_id = :r"), {"r": run_id}).scalars().all()
        wall = conn.execute(
            sa.text("SELECT extract(epoch FROM max(c.created_at) - r.created_at) FROM checkpoint c JOIN run r ON r.id = c.run_id WHERE c.run_id = :r GROUP BY r.created_at"),
            {"r": run_id},
        ).scalar_one()
    return {"evals": [tuple(map(float, e)) for e in evals], "tokens": [e[3] for e in evals], "lags": list(lags), "wall": float(wall)}


def _plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(11, 4))
    for label, r in results.items():
        versions, seconds, success, tokens = zip(*r["evals"])
        by_time.plot(seconds, success, marker="o", label=label)
        by_tokens.plot(tokens, success, marker="o", label=label)
    by_time.set(xlabel="wall-clock (s)", ylabel="held-out success", title="eval success vs time")
    by_tokens.set(xlabel="trained tokens", title="eval success vs trained tokens")
    by_time.legend()
    fig.tight_layout()
    fig.savefig(out / "policy_lag.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = list(results)
    top = max(max(r["lags"]) for r in results.values())
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        lags = results[label]["lags"]
        counts = [lags.count(v) / len(lags) for v in range(top + 1)]
        ax.bar([v + i * width for v in range(top + 1)], counts, width=width, label=label)
    ax.set(xlabel="version lag of trained samples", ylabel="fraction", title="version lag per setting")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "policy_lag_versions.png", dpi=120)


if __name__ == "__main__":
    main()
