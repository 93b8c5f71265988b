"""The ledger under many rollout workers: 1, 4, 16 and 64 processes claiming slots and committing trajectories.

    python -m benchmarks.ledger_scale [--clients 1,16] [--turns 16] [--variants before,after] [--seconds 15] [--profile small|coding]
    python -m benchmarks.ledger_scale --fleet [--leases 1000,10000,100000]

Each client is a process with its own connection doing what a rollout worker does per episode: claim one
slot (FOR UPDATE SKIP LOCKED, with its lease), then commit one trajectory for it (binary COPY). All
clients of a level start together and run for `--seconds`; the table gives claims/s and commits/s over
the level, p50/p95 latency of each operation, and the errors a worker would see (deadlocks and
serialisation failures must be 0), and the bytes the ledger grew by per trajectory (its rows, TOAST and indexes).

`--variants`, side by side in one run (the machine's noise alike), each `storage/encoder/batch` or a name:
  storage  `whole`: each segment stores its whole prompt (the ledger before issue 49: ids grow with the square
           of the turns); `linear`: only what the previous segment does not hold (the ledger now);
  encoder  `lists`: psycopg dumps each array element by element (before); `packed`: numpy packs them (now);
  batch    trajectories per commit (a rollout worker's group commit puts what finishes while a commit is in
           flight into the next one: 1 is an idle worker's, 8 a loaded one's; a client then claims that many
           slots at once too).
  `before` = whole/lists/1, `after` = linear/packed/8.
Profiles: `small` is a short agent (a 256-token prompt, 64 generated and 32 tool-output tokens a turn);
`coding` a coding agent's (a 1,024-token prompt, 256 generated and 256 tool-output tokens a turn: at 16 turns
the 82k ids of its prompts, of which the linear ledger stores the 8,960 that each segment adds: 9.1x fewer).
`--turns` sets the turns (4, 16, 64, 128: agentic RL's long horizons); `whole` is run up to 16 turns only
(at 128 it would store 4.3M ids a trajectory) and its row says so.

Clients and PostgreSQL share this machine's cores, so past a few clients the numbers measure the CPU,
not the ledger: the ratios between levels are the finding, and the README's paper estimate uses them.
`--fleet` (issue 63), instead: the ids agents that rewrite their history store (re-rendering, trimming,
summarising) against an appending agent's; the learner's read of 64 trajectories of 128 turns (seconds, and the
memory it adds to a fresh client process against the bytes the ledger stores for them; the whole-prompt read of
before on 4 of them); lease renewal, expiry and claim with 1,000 to 100,000 leases in flight.

Runs in a scratch database next to the ledger (LOOPLINE_DATABASE_URL or the embedded server).
"""

from __future__ import annotations

import argparse
import dataclasses
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

PROFILES = {"small": (256, 64, 32), "coding": (1024, 256, 256)}  # first prompt, generated per turn, tool output per turn
NAMED = {"before": "whole/lists/1", "after": "linear/packed/8"}
ENCODERS = {"lists": "copy_lists", "packed": "copy"}  # -> ledger.BulkMethod
WHOLE_UP_TO = 16  # turns


@dataclasses.dataclass(frozen=True)
class Variant:
    storage: str
    encoder: str
    batch: int

    @classmethod
    def parse(cls, text: str) -> "Variant":
        storage, encoder, batch = NAMED.get(text, text).split("/")
        if storage not in ("whole", "linear") or encoder not in ENCODERS:
            raise SystemExit(f"--variants: {text!r} is not storage/encoder/batch (whole|linear / lists|packed / N) or {sorted(NAMED)}")
        return cls(storage, encoder, int(batch))

    def __str__(self) -> str:
        return f"{self.storage}/{self.encoder}/{self.batch}"


def _trajectory(rng: random.Random, profile: str, turns: int, storage: str):
    trajectory = multi_turn(rng, turns, *PROFILES[profile])
    if storage == "whole":  # a segment that starts a chain stores its whole prompt: the rows of the old ledger
        trajectory.segments[1:] = [dataclasses.replace(s, starts_chain=True) for s in trajectory.segments[1:]]
    return trajectory


def stored_ids(profile: str, turns: int, storage: str = "linear") -> int:
    first, generated, observation = PROFILES[profile]
    if storage == "whole":
        return sum(first + k * (generated + observation) + generated for k in range(turns))
    return _stored_ids(turns, first, generated, observation)


def _client(url: str, run_id: uuid.UUID, profile: str, turns: int, variant: Variant, seconds: float, ready, go, out) -> None:
    import psycopg
    import sqlalchemy.exc

    from loopline.store import ledger
    from loopline.store.db import make_engine, session

    rng = random.Random(os.getpid())
    batch = variant.batch
    work = [_trajectory(rng, profile, turns, variant.storage) for _ in range(max(1, min(8, 64 // turns)))]  # before the clock starts
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
                ledger.commit_trajectories(
                    s, [(lease.attempt_id, work[(len(commits) + i) % len(work)]) for i, lease in enumerate(leases)], method=ENCODERS[variant.encoder]
                )
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


def _ledger_bytes(engine) -> int:
    with engine.connect() as conn:
        return conn.exec_driver_sql("SELECT pg_total_relation_size('segment') + pg_total_relation_size('trajectory')").scalar_one()


def level(url: str, engine, clients: int, variant: Variant, seconds: float, profile: str, turns: int) -> dict:
    from loopline.store import ledger
    from loopline.store.db import session

    with session(engine) as s:
        run = ledger.create_run(s, f"scale-{clients}-{uuid.uuid4().hex[:6]}", {}, "file:///w")
        ledger.plan_step(s, run.id, 1, [f"t{i}" for i in range(2_500 * variant.batch)], group_size=4)
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(url, run.id, profile, turns, variant, seconds, ready, go, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:  # every process has imported, built its trajectories and connected
        ready.get(timeout=600)
    size_before = _ledger_bytes(engine)
    started = time.perf_counter()
    go.set()
    results = [out.get(timeout=seconds + 600) for _ in procs]
    elapsed = time.perf_counter() - started
    for p in procs:
        p.join()
    grown = _ledger_bytes(engine) - size_before
    claims = [x for r in results for x in r[0]]
    commits = [x for r in results for x in r[1]]
    errors = {k: sum(r[2][k] for r in results) for k in ("deadlock", "serialization", "other")}
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1000 if len(xs) > 1 else float("nan")  # noqa: E731
    return {
        "clients": clients, "variant": variant, "turns": turns, "bytes": grown / len(commits) if commits else float("nan"), "claims_s": len(claims) / elapsed, "commits_s": len(commits) / elapsed,
        "claim_p50": q(claims, 50), "claim_p95": q(claims, 95), "commit_p50": q(commits, 50), "commit_p95": q(commits, 95), **errors,
    }


# ---------------------------------------------------------------- issue 63: long horizons and large fleets


def _commit_for_reading(engine, trajectories: list, group_size: int = 4) -> list[uuid.UUID]:
    from loopline.store import ledger
    from loopline.store.db import session

    with session(engine) as s:
        run = ledger.create_run(s, f"read-{uuid.uuid4().hex[:6]}", {}, "file:///w")
        ledger.plan_step(s, run.id, 1, [f"t{i}" for i in range(-(-len(trajectories) // group_size))], group_size=group_size)
        leases = ledger.claim_slots(s, run.id, "bench", len(trajectories), split="train", lease_seconds=3600)
        ids = []
        for lease, trajectory in zip(leases, trajectories):  # (one at a time: a 128-turn commit is ~10 MB of rows)
            ids.append(ledger.commit_trajectory(s, lease.attempt_id, trajectory).trajectory_id)
    return ids


def _read_in_a_fresh_process(url: str, ids: list[uuid.UUID], path: str, out) -> None:
    """One learner read, timed, with the memory it added to this process (peak RSS over the RSS before)."""

    def rss(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    from loopline.pipeline.stages import load_sequences
    from loopline.store import ledger
    from loopline.store.db import make_engine, session
    from loopline.trainer.batch import sequences_from_trajectory

    engine = make_engine(url)
    with session(engine) as s:
        s.connection()
        s.rollback()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # (the peak so far, imports included, forgotten: VmHWM counts from here)
        before = rss("VmRSS:")
        t0 = time.perf_counter()
        if path == "chained":
            sequences = load_sequences(s, ids)
        else:  # the read before issue 63: every call's whole prompt, then the chains from them
            sequences = [q for t in ledger.load_trajectories(s, ids) for q in sequences_from_trajectory(t)]
        seconds = time.perf_counter() - t0
    out.put((seconds, rss("VmHWM:") - before, sum(len(q.input_ids) for q in sequences)))


def learner_read(console: Console, url: str, engine, trajectories: int, turns: int, profile: str, before_trajectories: int) -> None:
    """The learner's read of a batch of long trajectories: seconds and the client memory it adds, against the
    bytes the ledger stores for them; the whole-prompt read (before) on a few of them for comparison."""
    rng = random.Random(0)
    ids = _commit_for_reading(engine, [multi_turn(rng, turns, *PROFILES[profile]) for _ in range(trajectories)])
    with engine.connect() as conn:
        stored = conn.exec_driver_sql(
            "SELECT sum(pg_column_size(prompt_ids) + pg_column_size(generated_ids) + pg_column_size(action_loss_mask) "
            "+ pg_column_size(rollout_logprobs) + coalesce(pg_column_size(prompt_copies), 0))::bigint FROM segment WHERE trajectory_id = ANY(%(t)s)",
            {"t": ids},
        ).scalar_one()
    table = Table(title=f"the learner's read of {turns}-turn trajectories ({profile} profile; {stored / len(ids) / 1e6:.2f} MB stored each)")
    for column in ("read", "trajectories", "positions", "seconds", "s / trajectory", "client memory added", "x stored bytes"):
        table.add_column(column, justify="right")
    ctx = mp.get_context("spawn")
    for path, n in (("chained", trajectories), ("whole prompts (before)", before_trajectories)):
        out = ctx.Queue()
        proc = ctx.Process(target=_read_in_a_fresh_process, args=(url, ids[:n], "chained" if path == "chained" else "whole", out))
        proc.start()
        seconds, added, positions = out.get(timeout=1800)
        proc.join()
        share = stored * n / len(ids)
        table.add_row(path, str(n), f"{positions:,}", f"{seconds:.2f}", f"{seconds / n:.3f}", f"{added / 1e6:,.0f} MB", f"{added / share:.2f}x")
    console.print(table)


def _timed(fn, repeat: int = 15) -> float:
    """Median milliseconds of `fn()`."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def leases(console: Console, engine, levels: list[int], per_worker: int = 100) -> None:
    """Renewal (a worker's `per_worker` leases in one statement), expiry (the check every claim makes first,
    nothing expired) and a claim of 8 slots, with 1,000 to 100,000 leases in flight; and the renewal before
    issue 63 (one statement per lease, by lease_attempt_id: a scan of every leased slot) for comparison."""
    import sqlalchemy as sa

    from loopline.store import ledger
    from loopline.store.db import session

    table = Table(title=f"leases in flight ({os.cpu_count()} cores shared with PostgreSQL; median ms)")
    for column in ("leases in flight", f"renew {per_worker} (one statement)", "renew 1 (before: by lease_attempt_id)",
                   "expiry check", "claim 8", f"vs {levels[0]:,}"):
        table.add_column(column, justify="right")
    first = None
    for n in levels:
        with session(engine) as s:
            run = ledger.create_run(s, f"leases-{n}-{uuid.uuid4().hex[:6]}", {}, "file:///w")
            ledger.plan_step(s, run.id, 1, [f"t{i}" for i in range(n // 4)], group_size=4)
            ledger.plan_step(s, run.id, 2, [f"t{i}" for i in range(5_000)], group_size=4)  # pending, for the claims
            held: list = []
            while len(held) < n:
                held += ledger.claim_slots(s, run.id, f"w{len(held) // per_worker}", min(1_000, n - len(held)), split="train",
                                           lease_seconds=3600, max_step=1)
            s.commit()
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:  # (as autovacuum would have)
                conn.exec_driver_sql("VACUUM ANALYZE slot")
            mine = [lease.attempt_id for lease in held[:per_worker]]
            renew = _timed(lambda: ledger.renew_leases(s, mine, 3600))
            before = _timed(lambda: (s.execute(sa.text(
                "UPDATE slot SET lease_expires_at = now() + interval '1 hour' WHERE lease_attempt_id = :a AND state = 'leased' "
                "AND lease_expires_at > now() RETURNING id"), {"a": mine[0]}).first(), s.commit()))
            expire = _timed(lambda: ledger.expire_leases(s, run.id))
            claim = _timed(lambda: ledger.claim_slots(s, run.id, "claimer", 8, split="train", lease_seconds=3600))
        row = (renew, before, expire, claim)
        first = first or row
        table.add_row(f"{n:,}", *(f"{x:.2f}" for x in row), " / ".join(f"{x / f:.2f}x" for x, f in zip(row, first)))
    console.print(table)


def histories(console: Console, engine, turns: int, profile: str) -> None:
    """Ids stored for agents that rewrite their history, against an appending agent of the same turns."""
    from benchmarks._trajectories import HISTORIES, rewriting

    rng = random.Random(1)
    table = Table(title=f"agents that rewrite their history: ids stored ({turns} turns, {profile} profile)")
    for column in ("history", "calls that start a chain", "ids in their prompts", "ids stored", "x appending"):
        table.add_column(column, justify="right")
    appending = None
    for history in HISTORIES:
        trajectory = rewriting(rng, turns, *PROFILES[profile], history)
        (tid,) = _commit_for_reading(engine, [trajectory], group_size=1)
        with engine.connect() as conn:
            stored = conn.exec_driver_sql(
                "SELECT sum(cardinality(prompt_ids) + cardinality(generated_ids) + coalesce(cardinality(prompt_copies), 0)) "
                "FROM segment WHERE trajectory_id = %(t)s", {"t": tid},
            ).scalar_one()
        appending = appending or stored
        table.add_row(
            history, str(sum(s.starts_chain for s in trajectory.segments)),
            f"{sum(len(s.prompt_ids) + len(s.generated_ids) for s in trajectory.segments):,}", f"{stored:,}", f"{stored / appending:.2f}x",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--turns", default="16")
    parser.add_argument("--variants", default="before,after", help="storage/encoder/batch, comma-separated (see the module's doc)")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="coding")
    parser.add_argument("--fleet", action="store_true", help="instead of the commit levels: the learner's read of 64 x 128-turn "
                        "trajectories, leases from 1,000 to 100,000 in flight, and agents that rewrite their history")
    parser.add_argument("--leases", default="1000,10000,100000")
    args = parser.parse_args()
    console = Console(width=220)  # the table on one line per level, also into a file
    if args.fleet:
        with scratch_database() as (url, engine):
            histories(console, engine, 128, args.profile)
            learner_read(console, url, engine, 64, 128, args.profile, before_trajectories=4)
            leases(console, engine, [int(n) for n in args.leases.split(",")])
        return
    variants = [Variant.parse(v) for v in args.variants.split(",")]
    rows, skipped = [], []
    with scratch_database() as (url, engine):
        for turns in (int(t) for t in args.turns.split(",")):
            for clients in (int(c) for c in args.clients.split(",")):
                for variant in variants:  # (side by side: the machine's noise alike)
                    if variant.storage == "whole" and turns > WHOLE_UP_TO:
                        skipped.append((turns, clients, variant))
                        continue
                    rows.append(level(url, engine, clients, variant, args.seconds, args.profile, turns))
                    console.print(f"{turns} turns, {clients} clients, {variant}: {rows[-1]['commits_s']:.1f} commits/s")
    table = Table(title=f"ledger under N rollout workers ({args.profile} profile; {os.cpu_count()} cores shared with PostgreSQL)")
    for column in ("turns", "clients", "storage/encoder/batch", "stored ids", "bytes/traj", "claims/s", "commits/s", "vs before",
                   "claim p50/p95 ms", "commit p50/p95 ms", "deadlocks", "serialisation", "other errors"):
        table.add_column(column, justify="right")
    first = {}
    for r in rows:  # "vs before": the first variant's row at the same turns and clients
        key = (r["turns"], r["clients"])
        first.setdefault(key, r["commits_s"])
        table.add_row(
            str(r["turns"]), str(r["clients"]), str(r["variant"]), f"{stored_ids(args.profile, r['turns'], r['variant'].storage):,}",
            f"{r['bytes'] / 1024:,.0f} KiB", f"{r['claims_s']:.1f}", f"{r['commits_s']:.1f}", f"{r['commits_s'] / first[key]:.2f}x",
            f"{r['claim_p50']:.1f} / {r['claim_p95']:.1f}", f"{r['commit_p50']:.1f} / {r['commit_p95']:.1f}",
            str(r["deadlock"]), str(r["serialization"]), str(r["other"]),
        )
    for turns, clients, variant in skipped:
        table.add_row(str(turns), str(clients), str(variant), f"{stored_ids(args.profile, turns, 'whole'):,}", "not run", *[""] * 8)
    console.print(table)


if __name__ == "__main__":
    main()
