"""What verifying in a fresh sandbox costs an episode, side by side in one run, per backend.

    python -m benchmarks.fresh_verifier [--rounds 8] [--backends docker,local]

Each round plays examples/coding_env.yaml task c01 with its correct solution (start, reset, one write, verify,
close) and times:
  episode  the whole episode;
  verify   `Episode.verify`: the agent's outputs copied out, a fresh sandbox opened, the outputs copied in, the
           verifier run there, the fresh sandbox closed;
  fresh    one more verifier sandbox alone, opened, running `true`, closed: what the fresh sandbox adds to `verify`.
Medians; the ratios are to `episode`. E2B's cost is its cloud's sandbox start (not measurable here).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loopline.envregistry.episode import Episode, ToolCall
from loopline.envregistry.sandbox.backends import open_sandbox
from loopline.envregistry.sandbox.base import ROLE_LABEL, VERIFIER_ROLE
from loopline.envregistry.spec import Sandbox, load_spec
from loopline.envregistry.tasks import load_tasks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


async def _round(spec, task) -> dict[str, float]:
    started = time.perf_counter()
    episode = await Episode.start(spec, task)
    try:
        await episode.reset()
        await episode.step(ToolCall("write_file", {"path": "solution.py", "content": task.data["solution"]}))
        verify_started = time.perf_counter()
        verdict = await episode.verify("Done.")
        verify_s = time.perf_counter() - verify_started
    finally:
        await episode.close()
    episode_s = time.perf_counter() - started
    assert verdict.reward == 1.0, verdict
    fresh_started = time.perf_counter()
    box = await open_sandbox(spec.sandbox, {ROLE_LABEL: VERIFIER_ROLE})
    try:
        await box.exec("true", 10)
    finally:
        await box.close()
    return {"episode": episode_s, "verify": verify_s, "fresh": time.perf_counter() - fresh_started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--backends", default="docker,local")
    args = parser.parse_args()
    coding = load_spec(EXAMPLES / "coding_env.yaml")
    task = next(t for t in load_tasks(coding, EXAMPLES) if t.id == "c01")
    table = Table(title=f"coding_env c01, correct solution: medians of {args.rounds} rounds")
    for column in ("backend", "episode s", "verify s", "fresh s", "verify / episode", "fresh / episode"):
        table.add_column(column, justify="right")
    for backend in args.backends.split(","):
        if backend == "local" and shutil.which("bwrap") is None:
            continue
        sandbox = coding.sandbox if backend == "docker" else Sandbox(backend=backend)
        spec = coding.model_copy(update={"sandbox": sandbox})
        asyncio.run(_round(spec, task))  # (warm: the image's first container, Python's imports)
        rounds = [asyncio.run(_round(spec, task)) for _ in range(args.rounds)]
        median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        table.add_row(
            backend, f"{median['episode']:.3f}", f"{median['verify']:.3f}", f"{median['fresh']:.3f}",
            f"{median['verify'] / median['episode']:.2f}", f"{median['fresh'] / median['episode']:.2f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
