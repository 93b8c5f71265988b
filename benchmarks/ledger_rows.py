"""Which row format for a segment's arrays: bytes stored, write and read cost, side by side in one run.

    python -m benchmarks.ledger_rows [--trajectories 200] [--turns 16] [--rounds 3]

Each format is a scratch table holding what the ledger's segment rows hold for a coding agent's trajectory
(the linear storage: 1,024 prompt ids, then 256 generated and 256 tool-output ids a turn; a mask and a
logprob per generated id). The formats:
  arrays        int4[] ids, int2[] mask, float8[] logprobs, PostgreSQL's default TOAST compression (pglz):
                the ledger's rows today;
  float4        the same with float4[] logprobs (both engines produce float32 logprobs: lossless for them);
  arrays-plain  int4[] / float8[] stored uncompressed (STORAGE EXTERNAL: no pglz attempt on write);
  arrays-lz4    int4[] / float8[] with lz4 TOAST compression (where the server has it: Debian's PostgreSQL
                does, the embedded server's build does not);
  bytea         packed little-endian int32 ids, uint8 mask, float32 logprobs in bytea, pglz;
  bytea-lz4     the same with lz4 TOAST compression (where the server has it).
Token ids are drawn two ways: uniform over a 150k vocabulary (incompressible: the worst case) and Zipf
(s=1.1) over SmolLM2's 49,152 ids (text-like: frequent tokens have small ids). Writes are binary COPY from
one connection, 8 trajectories a transaction, every format in each round (machine noise alike); reads
fetch one trajectory's rows and decode them to Python lists, as the trainer's reader does.
Runs in a scratch database next to the ledger (LOOPLINE_DATABASE_URL or the embedded server).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks._scratch import scratch_database
from loopline.store.packed import use_packed_arrays

FORMATS = {  # name -> (column types of ids, mask, logprobs; storage clause or None)
    "arrays": (("int4[]", "int2[]", "float8[]"), None),
    "float4": (("int4[]", "int2[]", "float4[]"), None),
    "arrays-plain": (("int4[]", "int2[]", "float8[]"), "SET STORAGE EXTERNAL"),
    "arrays-lz4": (("int4[]", "int2[]", "float8[]"), "SET COMPRESSION lz4"),
    "bytea": (("bytea", "bytea", "bytea"), None),
    "bytea-lz4": (("bytea", "bytea", "bytea"), "SET COMPRESSION lz4"),
}
COLUMNS = ("prompt_ids", "generated_ids", "action_loss_mask", "rollout_logprobs")


def segments(rng: np.random.Generator, turns: int, ids: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(prompt suffix, generated ids, mask, float32 logprobs) of each turn, as the linear ledger stores them."""
    def draw(n: int) -> np.ndarray:
        if ids == "uniform":
            return rng.integers(0, 150_000, n, dtype=np.int32)
        return np.minimum(rng.zipf(1.1, n) - 1, 49_151).astype(np.int32)

    out = []
    for turn in range(turns):
        prompt = draw(1024 if turn == 0 else 256)  # the first prompt, then the previous turn's tool output
        generated = draw(256)
        logprobs = (-np.exp(rng.normal(-3.0, 2.0, 256))).astype(np.float32)  # mostly near 0, a long tail
        out.append((prompt, generated, np.ones(256, dtype=np.int16), logprobs))
    return out


def _value(kind: str, array: np.ndarray):
    if kind == "bytea":  # ids int32, the mask a byte, logprobs float32; little-endian, as numpy reads them back
        packed = "u1" if array.dtype == np.int16 else {"i": "<i4", "f": "<f4"}[array.dtype.kind]
        return array.astype(packed).tobytes()
    return array  # (the packed array dumpers take numpy arrays; float32 logprobs widen exactly to float8)


def _create(conn, name: str) -> None:
    (ids, mask, logprobs), storage = FORMATS[name]
    table = name.replace("-", "_")
    conn.exec_driver_sql(
        f"CREATE TABLE {table} (trajectory int, seq int, prompt_ids {ids}, generated_ids {ids}, "
        f"action_loss_mask {mask}, rollout_logprobs {logprobs}, PRIMARY KEY (trajectory, seq))"
    )
    if storage:
        for column in COLUMNS:
            conn.exec_driver_sql(f"ALTER TABLE {table} ALTER COLUMN {column} {storage}")


def write(raw, name: str, first: int, trajectories: list, batch: int = 8) -> float:
    (ids, mask, logprobs), _ = FORMATS[name]
    types = ["int4", "int4", ids, ids, mask, logprobs]
    kinds = (ids, ids, mask, logprobs)
    start = time.perf_counter()
    for b in range(0, len(trajectories), batch):
        with raw.cursor() as cur:
            use_packed_arrays(cur)
            with cur.copy(f"COPY {name.replace('-', '_')} (trajectory, seq, {', '.join(COLUMNS)}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(types)
                for t, trajectory in enumerate(trajectories[b : b + batch], start=first + b):
                    for seq, arrays in enumerate(trajectory):
                        copy.write_row((t, seq, *(_value(k, a) for k, a in zip(kinds, arrays))))
        raw.commit()
    return time.perf_counter() - start


def read(raw, name: str, trajectory: int) -> list[list]:
    """One trajectory's rows decoded to Python lists (what the trainer's reader builds)."""
    (ids, mask, logprobs), _ = FORMATS[name]
    with raw.cursor() as cur:
        rows = cur.execute(f"SELECT {', '.join(COLUMNS)} FROM {name.replace('-', '_')} WHERE trajectory = %s ORDER BY seq", (trajectory,)).fetchall()
    if ids != "bytea":
        return [list(map(list, r)) for r in rows]
    dtypes = ("<i4", "<i4", "u1", "<f4")
    return [[np.frombuffer(v, d).tolist() for v, d in zip(r, dtypes)] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=200, help="per format, id distribution and round")
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    console = Console(width=200)
    table = Table(title=(
        f"segment row formats: {args.turns}-turn coding trajectories, {args.trajectories} x {args.rounds} per cell, "
        "binary COPY 8 per transaction, one connection"
    ))
    for column in ("ids", "format", "KiB / trajectory", "vs arrays", "writes / s", "vs arrays", "read ms (p50)", "vs arrays"):
        table.add_column(column, justify="right")
    with scratch_database() as (_, engine):
        raw = engine.raw_connection().driver_connection
        formats = list(FORMATS)
        try:
            raw.execute("CREATE TEMP TABLE probe (b bytea COMPRESSION lz4)")
            raw.rollback()
        except Exception as exc:  # PostgreSQL built without lz4
            raw.rollback()
            formats = [f for f in formats if not f.endswith("lz4")]
            console.print(f"lz4 formats left out: {str(exc).splitlines()[0]}")
        for distribution in ("uniform", "zipf"):
            with engine.begin() as conn:
                for name in formats:
                    conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name.replace('-', '_')}")
                    _create(conn, name)
            work = [segments(rng, args.turns, distribution) for _ in range(args.trajectories)]
            seconds = {name: 0.0 for name in formats}
            for r in range(args.rounds):
                for name in formats[r % len(formats):] + formats[: r % len(formats)]:  # each round all, in turns first
                    seconds[name] += write(raw, name, r * len(work), work)
            reads = {name: [] for name in formats}
            for t in range(0, args.trajectories * args.rounds, max(1, args.trajectories * args.rounds // 100)):
                for name in formats:
                    start = time.perf_counter()
                    decoded = read(raw, name, t)
                    reads[name].append(time.perf_counter() - start)
                    assert decoded[0][1] == work[t % len(work)][0][1].tolist()  # the ids come back exact
            raw.execute("CHECKPOINT")
            n = args.trajectories * args.rounds
            stats = {}
            for name in formats:
                size = raw.execute(f"SELECT pg_total_relation_size('{name.replace('-', '_')}')").fetchone()[0]
                stats[name] = (size / n / 1024, n / seconds[name], statistics.median(reads[name]) * 1000)
            raw.rollback()
            base = stats["arrays"]
            for name in formats:
                kib, rate, ms = stats[name]
                table.add_row(distribution, name, f"{kib:,.1f}", f"{kib / base[0]:.2f}x", f"{rate:,.0f}", f"{rate / base[1]:.2f}x",
                              f"{ms:.2f}", f"{ms / base[2]:.2f}x")
        raw.close()
    console.print(table)


if __name__ == "__main__":
    main()
