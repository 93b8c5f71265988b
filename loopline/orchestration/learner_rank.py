"""One rank of a learner launched through DeepSpeed's launcher (`learner_launch`): rank 0 runs the train flow
as it would run alone and writes its result for the launching flow; the other ranks follow its learner."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from loopline.pipeline import learner_launch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loopline.orchestration.learner_rank")
    parser.add_argument("--config")
    parser.add_argument("--resume")
    parser.add_argument("--fork")
    parser.add_argument("--result", required=True)
    parser.add_argument("--parent", required=True)
    args = parser.parse_args(argv)
    os.environ[learner_launch.LAUNCHED] = args.parent
    learner_launch.watch(args.parent)
    from loopline.trainer import ranks  # (after the watch: importing torch takes seconds)

    rank = ranks.join()
    scratch = Path(args.result).parent
    if missing := ranks.ranks_missing(scratch):
        said = learner_launch.unshared_home(missing, scratch)
        if rank == 0 and scratch.is_dir():
            Path(args.result).write_text(json.dumps({"error": said}))
        sys.exit(f"error: {said}")
    if rank != 0:
        ranks.follow()
        return
    from loopline.flows.train import train  # (rank 0 only: the followers need no Prefect)

    try:
        summary = train.with_options(flow_run_name="learner-rank-0")(args.config, resume=args.resume, fork=args.fork)
        outcome = {"summary": summary}
    except BaseException as exc:  # the flow's message for the launching process; the ranks are killed by the launcher
        Path(args.result).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise
    ranks.finish()
    Path(args.result).write_text(json.dumps(outcome))


if __name__ == "__main__":
    main()
