"""The `replay` flow: re-run one learner step of a run from its records and compare the weights it makes.

`loopline replay RUN --step N` rebuilds the learner as it was before step N (the newest full checkpoint
at or before step N-1 still on disk, else the run's initial weights, then the recorded batches of the
steps since, replayed), trains step N on exactly the batch the ledger says it consumed, and compares
the sha256 of the weights it makes with the one recorded for version N (`checkpoint.tensors_sha256`); each
step replayed on the way is compared with its own version alike. On CPU the two are equal bit for
bit, under any load: no kernel of the learner depends on thread scheduling, and each step is replayed with the thread
count it was trained with. On a GPU, kernels may differ in the last bits (the sha256 differs); where a
resume went on from such a rebuild, the ledger holds the rebuild's digest, and a replay equal to it
reproduced the run as it went on.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from loopline.errors import LooplineError
from loopline.pipeline import assembly
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


def _verdict(session, run_id, step: int, digest: str) -> dict:
    """One replayed step's digest against what the ledger holds for its version."""
    recorded = ledger.version_weights(session, run_id, step).sha256
    rebuilt = digest != recorded and digest in ledger.rebuilt_digests(session, run_id, step)
    return {"step": step, "sha256": digest, "recorded_sha256": recorded, "reproduced": digest == recorded or rebuilt, "rebuilt": rebuilt}


@flow(name="replay", **RESULT)
def replay_step(run: str, step: int) -> dict:
    """Retrain learner step `step` of `run` from the records; `reproduced` says whether the sha256 matches.
    The steps replayed on the way (those since the checkpoint it starts from) are compared too: `steps`."""
    log = get_run_logger()
    parts = assembly.open_named_run(run)
    with parts.session() as s:
        newest = ledger.version_weights(s, parts.run_id).version
    if not 1 <= step <= newest:
        raise LooplineError(f"run {parts.config.name} has committed learner steps 1 to {newest}; replay one of them")
    restored, since = _restore_point(parts.workdir(), step)
    log.info("replaying steps %d..%d of %s from %s", since + 1, step, run, restored or "the initial weights")
    verdicts: list[dict] = []

    def compare(learner, k: int) -> None:
        with parts.session() as s:
            verdicts.append(_verdict(s, parts.run_id, k, learner.weights_sha256()))
        v = verdicts[-1]
        said = "equal" if v["sha256"] == v["recorded_sha256"] else "equal to the rebuild the run went on from" if v["rebuilt"] else "DIFFERENT"
        log.info("step %d: replayed sha256 %s, recorded %s: %s", k, v["sha256"][:12], (v["recorded_sha256"] or "none")[:12], said)

    assembly.restore_learner(parts, restored, step, after_each=compare)
    return {"run": run, "from_step": since, **verdicts[-1], "steps": verdicts}
