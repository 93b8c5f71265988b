"""Ledger write and claim throughput, measured side by side in one run.

    python -m benchmarks.ledger_write [--trajectories 256] [--rounds 3]

Commits trajectories of 4 turns (a 256-token prompt, 256 generated tokens a
turn with mask and logprobs; each segment stores its whole context) through binary COPY and through
executemany, alternating the two in every round so machine noise hits both
alike, and prints trajectories/s and the COPY/executemany ratio, for a worker
committing one trajectory per transaction and for batches of 32. Then 1 and 4
processes claim 2,000 slots and it prints claims/s.

Runs in a scratch database created next to the ledger (LOOPLINE_DATABASE_URL,
or the embedded server) and dropped afterwards.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time
import uuid

from rich.console import Console
from rich.table import Table

from benchmarks._scratch import scratch_database
from benchmarks._trajectories import multi_turn

from loopline.store import ledger
from loopline.store.db import make_engine, session
from loopline.types import TrajectoryRecord

TOKENS = 256
SEGMENTS = 4


def make_trajectory(rng: random.Random) -> TrajectoryRecord:
    return multi_turn(rng, SEGMENTS, TOKENS, TOKENS, 0)


def commit_rate(engine, method: str, n: int, batch: int, rng: random.Random) -> float:
    """Trajectories/s for committing `n` claimed slots, `batch` per transaction (claims not timed)."""
    with session(engine) as s:
        run = ledger.create_run(s, f"bench-{uuid.uuid4().hex[:8]}", {}, "file:///w")
        ledger.plan_step(s, run.id, 1, [f"t{i}" for i in range(n // 4)], group_size=4)
        leases = ledger.claim_slots(s, run.id, "bench", n, split="train", lease_seconds=3600)
        work = [(lease.attempt_id, make_trajectory(rng)) for lease in leases]
        start = time.perf_counter()
        for i in range(0, len(work), batch):
            ledger.commit_trajectories(s, work[i : i + batch], method=method)
        return len(work) / (time.perf_counter() - start)


def _claimer(url: str, run_id: uuid.UUID, go, out) -> None:
    engine = make_engine(url)
    claimed = 0
    with session(engine) as s:
        go.wait()
        while leases := ledger.claim_slots(s, run_id, "bench", 1, split="train"):
            claimed += len(leases)
    out.put(claimed)
    engine.dispose()


def claim_rate(url: str, engine, claimers: int, slots: int = 2000) -> float:
    with session(engine) as s:
        run = ledger.create_run(s, f"bench-claim-{uuid.uuid4().hex[:8]}", {}, "file:///w")
        ledger.plan_step(s, run.id, 1, [f"t{i}" for i in range(slots // 4)], group_size=4)
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(url, run.id, go, out)) for _ in range(claimers)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # let every process import and connect before the clock starts
    start = time.perf_counter()
    go.set()
    total = sum(out.get(timeout=600) for _ in procs)
    elapsed = time.perf_counter() - start
    for p in procs:
        p.join()
    assert total == slots, f"claimed {total} of {slots}"
    return total / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=256, help="per measurement (multiple of 32)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    console = Console()
    with scratch_database() as (url, engine):
        rng = random.Random(0)
        rates: dict[tuple[int, str], list[float]] = {}
        for _ in range(args.rounds):
            for batch in (1, 32):
                for method in ("copy", "executemany"):
                    rates.setdefault((batch, method), []).append(
                        commit_rate(engine, method, args.trajectories, batch, rng)
                    )
        table = Table(title=f"commit: {SEGMENTS} segments x {TOKENS} prompt + {TOKENS} generated tokens, median of {args.rounds} rounds")
        table.add_column("per transaction")
        table.add_column("COPY (traj/s)", justify="right")
        table.add_column("executemany (traj/s)", justify="right")
        table.add_column("COPY / executemany", justify="right")
        for batch in (1, 32):
            copy, many = (statistics.median(rates[(batch, m)]) for m in ("copy", "executemany"))
            table.add_row(str(batch), f"{copy:.0f}", f"{many:.0f}", f"{copy / many:.2f}x")
        console.print(table)

        one, four = claim_rate(url, engine, 1), claim_rate(url, engine, 4)
        claims = Table(title="claim (FOR UPDATE SKIP LOCKED, 1 slot per claim, 2,000 slots)")
        claims.add_column("claimers")
        claims.add_column("claims/s", justify="right")
        claims.add_row("1", f"{one:.0f}")
        claims.add_row("4", f"{four:.0f} ({four / one:.2f}x of 1)")
        console.print(claims)


if __name__ == "__main__":
    main()
