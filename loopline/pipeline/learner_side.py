"""The learner and what it owns in a training process: the version it holds, the run's checkpoints and weight
exports on disk, and how to rebuild it when a step changed its weights without committing.

Kept apart from the loop's context (the run, the ledger, the engine, the plan's sizes) because this is the
state that changes as steps are trained, and the rules that keep it exact live together: a step retried
after a failed commit first restores the committed version; only a commit that lands names the files a
step wrote; the newest checkpoint a commit named is never pruned.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from loopline.config import LearnerSettings, RunConfig
from loopline.trainer.checkpoint import DiskFull
from loopline.trainer.learner import Learner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Written:
    """What one learner step wrote, named by its commit (or removed if the commit does not land)."""

    checkpoint: Path | None  # a full checkpoint, every `checkpoint_every` steps and at the last
    weights: Path | None  # the new version's weights, when `export_version` says
    adapter: Path | None  # a LoRA run on SGLang: the version's adapter alone
    sha256: str  # of the new version's weights, recorded with the commit
    timings: dict[str, float]

    def remove(self) -> None:
        for path in (self.checkpoint, self.weights, self.adapter):
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)


@dataclass(kw_only=True)
class LearnerSide:
    learner: Learner | None  # None when the run has no step left to train
    workdir: Path  # checkpoints/, weights/, adapters/
    # The committed version the learner holds in memory; None from the moment a step changes the weights
    # until its commit lands. A step retried after a failed commit finds None and restores the learner
    # with `restore(checkpoint_uri, through_step)` first: it must not train the same batch twice.
    version: int | None = 0
    restore: Callable[[str, int], Learner] | None = None
    # The run config's `learner:` section, whole: a full checkpoint every `checkpoint_every` steps (and at
    # `last_step`; a resume replays the recorded batches since the newest), and how many checkpoints and weight
    # exports are kept (besides those `keep_version` names: evaluated ones).
    settings: LearnerSettings = field(default_factory=LearnerSettings)
    last_step: int | None = None
    checkpoint_uri: str = ""  # the newest full checkpoint a commit named ("": none yet, replay from the initial weights)
    keep_version: Callable[[int], bool] | None = None
    # Which versions are written to disk (for other processes, evaluations, forks); the in-process engine
    # takes the others from the learner's memory when `sync_from_memory`.
    export_version: Callable[[int], bool] = field(default=lambda version: True)
    sync_from_memory: bool = False
    adapters: bool = False  # write each version's adapter (LoRA on SGLang)
    # A directory this learner wrote -> the URI its commit names (`weights.store`: the trainer serves it, or a
    # shared filesystem or object store holds a copy); a bare path where nothing else loads the run's weights.
    publish: Callable[[Path], str] = str

    @classmethod
    def for_run(
        cls, config: RunConfig, learner: Learner | None, workdir: Path, version: int, checkpoint_uri: str,
        restore: Callable[[str, int], Learner], publish: Callable[[Path], str],
    ) -> "LearnerSide":
        """The learner side of a run: what to keep, write and sync as its config says, around the live state."""
        return cls(
            learner=learner, workdir=workdir, version=version, restore=restore, checkpoint_uri=checkpoint_uri,
            settings=config.learner, last_step=config.steps,
            keep_version=config.evaluates, export_version=config.exports,
            sync_from_memory=config.engine.in_process, adapters=config.syncs_adapters, publish=publish,
        )

    def held_weights(self, version: int) -> Mapping[str, torch.Tensor] | None:
        """`version`'s weights when the learner holds them in memory; None: the engine loads them from disk."""
        if self.sync_from_memory and self.learner is not None and self.version == version:
            return self.learner.state_dict()
        return None

    def at(self, version: int, step: int) -> Learner:
        """The learner holding committed `version`, to train learner step `step`: restored first when an
        earlier try of the step changed its weights without committing."""
        if self.version != version:
            if self.restore is None:
                raise RuntimeError(
                    f"learner step {step}: the learner holds weights past v{version} (an uncommitted step) "
                    "and cannot restore them here; restart the run to resume from the ledger"
                )
            log.warning("learner step %d: an earlier try changed the weights without committing; restoring v%d", step, version)
            self.learner = None  # free the old one before the new one is built
            self.learner = self.restore(self.checkpoint_uri, step - 1)
            self.version = version
        assert self.learner is not None
        return self.learner

    def write(self, step: int, version: int) -> Written:
        """Write what step `step` (which made `version`) leaves on disk. Directories carry this process's pid
        (a learner that lost the run to another never touches the files the winner's commits name); a
        full disk gives back what this step wrote before raising."""
        assert self.learner is not None
        mine = f".{os.getpid()}"
        started = time.monotonic()
        checkpoint = weights = adapter = None
        try:
            if step % self.settings.checkpoint_every == 0 or step == self.last_step:
                checkpoint = self.learner.save_checkpoint(
                    self.workdir / "checkpoints" / f"step-{step:06d}{mine}", version, {"learner_step": step}
                )
            written_at = time.monotonic()
            digest = self.learner.weights_sha256()
            if self.export_version(version):
                weights = self.learner.export_weights(self.workdir / "weights" / f"v{version:06d}{mine}")
            if self.adapters:
                adapter = self.learner.export_adapter(self.workdir / "adapters" / f"v{version:06d}{mine}")
        except DiskFull:
            Written(checkpoint, weights, adapter, "", {}).remove()
            raise
        timings = {"checkpoint_s": written_at - started, "export_s": time.monotonic() - written_at}
        return Written(checkpoint, weights, adapter, digest, timings)

    def committed(self, version: int, written: Written) -> None:
        self.version = version
        if written.checkpoint is not None:
            self.checkpoint_uri = str(written.checkpoint)
        self.prune()

    def prune(self) -> None:
        """Delete checkpoints and exports nobody needs: all but the newest `keep_checkpoints` full checkpoints
        (never the one the newest commit named) and all but the newest `keep_exports` exports (never one
        `keep_version` keeps). Disk per step is then about 1/checkpoint_every of a full checkpoint."""
        checkpoints = sorted((self.workdir / "checkpoints").glob("step-*"))
        for old in checkpoints[: -self.settings.keep_checkpoints or None]:
            if str(old) != self.checkpoint_uri and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        exports = sorted((self.workdir / "weights").glob("v*"))
        for old in exports[: -self.settings.keep_exports or None]:
            number = re.match(r"v(\d+)", old.name)  # v000006 or v000006.PID
            version = int(number.group(1)) if number else None
            if version is not None and not (self.keep_version and self.keep_version(version)):
                shutil.rmtree(old, ignore_errors=True)
        adapters = sorted((self.workdir / "adapters").glob("v*"))
        for old in adapters[: -self.settings.keep_exports or None]:  # (the servers unload all but the newest two)
            shutil.rmtree(old, ignore_errors=True)
