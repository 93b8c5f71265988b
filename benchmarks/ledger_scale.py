"""The ledger under many rollout workers: 1, 4, 16 and 64 processes claiming slots and committing trajectories.

    python -m benchmarks.ledger_scale [--clients 1,4,16,64] [--batches 1,8] [--seconds 15] [--profile small|coding]

Each client is a process with its own connection doing what a rollout worker does per episode: claim one
slot (FOR UPDATE SKIP LOCKED, with its lease), then commit one trajectory for it (binary COPY). All
clients of a level start together and run for `--seconds`; the table gives claims/s and commits/s over
the level, p50/p95 latency of each operation, and the errors a worker would see (deadlocks and
serialisation failures must be 0). `--batches`: trajectories per commit, side by side in one run (a rollout
worker's group commit puts what finishes while a commit is in flight into the next one: 1 is an idle
worker's, 8 a loaded one's; each client then claims that many slots at once too). Profiles: `small` is a short agent (4 turns: a 256-token prompt, 64
generated and 32 tool-output tokens a turn); `coding` a coding agent's (16 turns: a 1,024-token prompt,
256 generated and 256 tool-output tokens a turn: the 82k ids of its prompts, of which the ledger stores the
8,960 that each segment adds to the previous one's: 9.1x fewer).

Clients and PostgreSQL share this machine's cores, so past a few clients the numbers measure the CPU,
not the ledger: the ratios between levels are the finding, and the README's paper estimate uses them.
Runs in a scratch database next to the ledger (LOOPLINE_DATABASE_URL or the embedded server).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
import uuid

from rich.console import Console
from rich.table import Table

from benchmarks._scratch import scratch_database
from benchmarks._trajectories import multi_turn
from benchmarks._trajectories import stored_ids as _stored_ids

PROFILES = {"small": (4, 256, 64, 32), "coding": (16, 1024, 256, 256)}  # turns, first prompt, generated per turn, tool output per turn


def _trajectory(rng: random.Random, profile: str):
    return multi_turn(rng, *PROFILES[profile])


def stored_ids(profile: str) -> int:
    return _stored_ids(*PROFILES[profile])


def _client(url: str, run_id: uuid.UUID, profile: str, batch: int, seconds: float, ready, go, out) -> None:
    import psycopg
    import sqlalchemy.exc

    from loopline.store import ledger
    from loopline.store.db import make_engine, session

    rng = random.Random(os.getpid())
    work = [_trajectory(rng, profile) for _ in range(8)]  # made before the clock starts
    engine = make_engine(url)
    claims, commits, errors = [], [], {"deadlock": 0, "serialization": 0, "other": 0}
    worker = f"bench:{os.getpid()}"
    with session(engine) as s:
        s.connection()  # connected before the clock starts
        s.rollback()
        ready.put(os.getpid())
        go.wait()
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            try:
                t0 = time.perf_counter()
                leases = ledger.claim_slots(s, run_id, worker, batch, split="train", lease_seconds=600)
                t1 = time.perf_counter()
                if not leases:
                    break
                ledger.commit_trajectories(s, [(lease.attempt_id, work[(len(commits) + i) % len(work)]) for i, lease in enumerate(leases)])
                t2 = time.perf_counter()
            except sqlalchemy.exc.DBAPIError as exc:
                s.rollback()
                kind = "deadlock" if isinstance(exc.orig, psycopg.errors.DeadlockDetected) else (
                    "serialization" if isinstance(exc.orig, psycopg.errors.SerializationFailure) else "other")
                errors[kind] += 1
                continue
            claims.append(t1 - t0)
            commits += [t2 - t1] * len(leases)  # (each trajectory waited for its batch's commit)
    engine.dispose()
    out.put((claims, commits, errors))


def level(url: str, engine, clients: int, batch: int, seconds: float, profile: str) -> dict:
    from loopline.store import ledger
    from loopline.store.db import session

    with session(engine) as s:
        run = ledger.create_run(s, f"scale-{clients}-{uuid.uuid4().hex[:6]}", {}, "file:///w")
        ledger.plan_step(s, run.id, 1, [f"t{i}" for i in range(2_500 * batch)], group_size=4)
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(url, run.id, profile, batch, seconds, ready, go, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:  # every process has imported, built its trajectories and connected
        ready.get(timeout=600)
    started = time.perf_counter()
    go.set()
    results = [out.get(timeout=seconds + 600) for _ in procs]
    elapsed = time.perf_counter() - started
    for p in procs:
        p.join()
    claims = [x for r in results for x in r[0]]
    commits = [x for r in results for x in r[1]]
    errors = {k: sum(r[2][k] for r in results) for k in ("deadlock", "serialization", "other")}
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1000 if len(xs) > 1 else float("nan")  # noqa: E731
    return {
        "clients": clients, "batch": batch, "claims_s": len(claims) / elapsed, "commits_s": len(commits) / elapsed,
        "claim_p50": q(claims, 50), "claim_p95": q(claims, 95), "commit_p50": q(commits, 50), "commit_p95": q(commits, 95), **errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--batches", default="1,8", help="trajectories per commit, each a row of the table")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="coding")
    args = parser.parse_args()
    turns, first, generated, observation = PROFILES[args.profile]
    console = Console(width=200)  # the table on one line per level, also into a file
    rows = []
    with scratch_database() as (url, engine):
        for clients in (int(c) for c in args.clients.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):  # (side by side: the machine's noise alike)
                rows.append(level(url, engine, clients, batch, args.seconds, args.profile))
                console.print(f"{clients} clients, batches of {batch}: {rows[-1]['commits_s']:.1f} commits/s")
    table = Table(title=(
        f"ledger under N rollout workers ({args.profile}: {turns} turns, {stored_ids(args.profile):,} token ids per trajectory; "
        f"{os.cpu_count()} cores shared with PostgreSQL)"
    ))
    for column in ("clients", "batch", "claims/s", "commits/s", "vs 1 client, batch 1", "claim p50/p95 ms", "commit p50/p95 ms", "deadlocks", "serialisation", "other errors"):
        table.add_column(column, justify="right")
    base = rows[0]["commits_s"]
    for r in rows:
        table.add_row(
            str(r["clients"]), str(r["batch"]), f"{r['claims_s']:.1f}", f"{r['commits_s']:.1f}", f"{r['commits_s'] / base:.2f}x",
            f"{r['claim_p50']:.1f} / {r['claim_p95']:.1f}", f"{r['commit_p50']:.1f} / {r['commit_p95']:.1f}",
            str(r["deadlock"]), str(r["serialization"]), str(r["other"]),
        )
    console.print(table)


if __name__ == "__main__":
    main()
