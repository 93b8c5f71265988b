"""Components of your own, in a module of your own: a policy loss (CISPO) and an engine with settings of their
own (the built-in CPU engine, its batch capped), and a tracker (JSON lines).

Name the module in the run config's `imports:` and put its folder on PYTHONPATH (or pip install its package)
wherever the run has a process; each component is then chosen by name like a built-in
(`learner.loss: {policy_loss: cispo, lower_bound: false}`, `tracking: [jsonl]`, `engine: {kind: capped_local, max_batch: 8}`).
docs/how-to/extend.md walks through it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from loopline.config import TRACKERS, TrackerSettings
from loopline.rollout.engines.thread import EngineThread
from loopline.rollout.engines.registry import ENGINES, EngineKind, EngineRequest, EngineSettings
from loopline.trainer.config import POLICY_LOSSES, LossSettings, Surrogate


class CispoSettings(LossSettings):
    """The loss's own settings, beside the ones every loss shares (`clip_low`, `clip_high`, the correction, ...)."""

    lower_bound: bool = Field(True, description="bound the weight below at 1 - clip_low, as verl's cispo; false: above only, as MiniMax-M1 (its ε_low large)")


@POLICY_LOSSES.register("cispo", settings=CispoSettings)
def cispo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: CispoSettings) -> Surrogate:
    """CISPO (MiniMax-M1; verl's `cispo`): the ratio is clipped and detached, a weight on -A log π_θ, so a clipped
    token keeps its gradient (PPO's clip drops it)."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    low = 1 - config.clip_low if config.lower_bound else 0.0
    weight = ratio.clamp(low, 1 + config.clip_high).detach()
    clipped = (ratio < low) | (ratio > 1 + config.clip_high)
    return Surrogate(-weight * advantages * logp, ratio, clipped, torch.zeros_like(clipped))


@TRACKERS.register("jsonl")
class JsonLines:
    """Each ledger step's metrics as one line of `metrics.jsonl` in the run's directory."""

    def __init__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any], settings: TrackerSettings):
        workdir.mkdir(parents=True, exist_ok=True)
        self.file = (workdir / "metrics.jsonl").open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def artifact(self, directory: Path) -> None:
        pass

    def close(self) -> None:
        self.file.close()


class CappedLocal(EngineSettings):
    """The engine's own settings: its `engine:` section is validated against them (a typo is refused by name)."""

    max_batch: int = Field(8, ge=1, description="sequences one forward pass decodes at most (the built-in engine: all in flight)")


def capped_local(request: EngineRequest) -> EngineThread:
    from loopline.rollout.engines.local import LocalEngine  # (torch: only where an engine is built)

    settings: CappedLocal = request.settings
    return EngineThread(LocalEngine(request.weights, version=request.version, max_batch=min(settings.max_batch, request.concurrency)))


ENGINES.register("capped_local", settings=CappedLocal)(EngineKind(capped_local, in_process=True))
