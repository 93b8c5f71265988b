"""What getting a version to a host costs, side by side in one run: the trainer's weight server against a plain copy.

    python -m benchmarks.weight_fetch [--mb 538] [--rounds 3]

A model-sized directory (one safetensors-sized file of random bytes, as incompressible as weights, plus a config
and a tokenizer) is published as the trainer publishes a version (its manifest hashed), then, each round:
  copy     shutil.copytree to another directory on the same disk (what a shared filesystem costs at best);
  publish  the trainer's side: the manifest (every file's sha256) of a new export;
  fetch    another "host" (a store with its own cache that cannot read the trainer's path) fetching it from the
           trainer's weight server over loopback HTTP: download, then the digest check;
  cached   the same host asking again (a cache hit: nothing moves).
Loopback measures the software (uvicorn, httpx, hashing), not a network: on real hosts the link's bandwidth
bounds `fetch` too. Ratios are to `copy`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loopline.rollout.weights.server import WeightServer
from loopline.rollout.weights.store import WeightStore, digest_of


def _model(directory: Path, mb: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "tokenizer.json").write_bytes(os.urandom(2_000_000))
    with open(directory / "model.safetensors", "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=538, help="the weights file's size (SmolLM2-135M in fp32: 538)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"copy": [], "publish": [], "fetch": [], "cached": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = _model(root / "trainer" / "v000001.1", args.mb)
        server = WeightServer("127.0.0.1").start()
        try:
            trainer = WeightStore("bench", root / "trainer-cache", lambda run: (server.url, server.token), serve=server.allow)
            uri = trainer.publish(model)
            for k in range(args.rounds):
                started = time.perf_counter()
                shutil.copytree(model, root / f"copy-{k}")
                times["copy"].append(time.perf_counter() - started)
                shutil.rmtree(root / f"copy-{k}")
                started = time.perf_counter()
                digest_of(model)
                times["publish"].append(time.perf_counter() - started)
                host = WeightStore("bench", root / f"host-{k}", lambda run: (server.url, server.token))
                host._in_place = lambda path, digest: False  # (another host: the trainer's path is not on its disk)
                started = time.perf_counter()
                fetched = host.local(uri)
                times["fetch"].append(time.perf_counter() - started)
                started = time.perf_counter()
                assert host.local(uri) == fetched
                times["cached"].append(time.perf_counter() - started)
                shutil.rmtree(root / f"host-{k}")
        finally:
            server.stop()
    size = args.mb + 2
    copy = statistics.median(times["copy"])
    table = Table(title=f"a {size} MB version, median of {args.rounds} rounds", box=None)
    for column in ("", "seconds", "MB/s", "x copy"):
        table.add_column(column, justify="right")
    for name, measured in times.items():
        median = statistics.median(measured)
        table.add_row(name, f"{median:.3f}", f"{size / median:.0f}" if median > 1e-3 else "-", f"{median / copy:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
