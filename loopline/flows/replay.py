"""The `replay` flow: re-run one learner step of a run from its records and compare the weights it makes.

`loopline replay RUN --step N` rebuilds the learner as it was before step N (the newest full checkpoint
at or before step N-1 still on disk, else the run's initial weights, then the recorded batches of the
steps since, replayed), trains step N on exactly the batch the ledger says it consumed, and compares
the sha256 of the weights it makes with the one recorded for version N (`checkpoint.tensors_sha256`). On CPU the two are equal bit for
bit, under any load: no kernel of the learner depends on thread scheduling, and each step is replayed with the thread
count it was trained with. On a GPU, kernels may differ in the last bits (the sha256 differs); where a
resume went on from such a rebuild, the ledger holds the rebuild's digest, and a replay equal to it
reproduced the run as it went on.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from loopline.errors import LooplineError
from loopline.flows import assembly
from loopline.store import ledger
from loopline.tasks.loop import RESULT
from loopline.trainer import checkpoint


def _restore_point(workdir: Path, before: int) -> tuple[Path | None, int]:
    """The newest complete checkpoint on disk holding a step < `before`, and that step (0: none)."""
    best: tuple[Path | None, int] = (None, 0)
    for directory in (workdir / "checkpoints").glob("step-*"):
        marker = checkpoint.read_marker(directory)
        step = int((marker or {}).get("cursor", {}).get("learner_step", -1))
        if 0 < step < before and step > best[1]:
            best = (directory, step)
    return best


@flow(name="replay", **RESULT)
def replay_step(run: str, step: int) -> dict:
    """Retrain learner step `step` of `run` from the records; `reproduced` says whether the sha256 matches."""
    log = get_run_logger()
    parts = assembly.open_named_run(run)
    with parts.session() as s:
        recorded = ledger.version_weights(s, parts.run_id, step)
    if recorded.version != step or step < 1:
        raise LooplineError(f"run {run} has no committed learner step {step} (its versions go up to {recorded.version})")
    restored, since = _restore_point(parts.workdir(), step)
    log.info("replaying steps %d..%d of %s from %s", since + 1, step, run, restored or "the initial weights")
    digest = assembly.restore_learner(parts, restored, step).weights_sha256()
    with parts.session() as s:
        rebuilt = digest != recorded.sha256 and digest in ledger.rebuilt_digests(s, parts.run_id, step)
    reproduced = digest == recorded.sha256 or rebuilt
    verdict = "equal" if digest == recorded.sha256 else "equal to the rebuild the run went on from" if rebuilt else "DIFFERENT"
    log.info("step %d: replayed sha256 %s, recorded %s: %s", step, digest[:12], (recorded.sha256 or "none")[:12], verdict)
    return {
        "run": run, "step": step, "from_step": since, "sha256": digest, "recorded_sha256": recorded.sha256,
        "reproduced": reproduced, "rebuilt": rebuilt,
    }
