"""Components of your own, in a module of your own: a policy loss (CISPO) and a tracker (JSON lines).

Name the module in the run config's `imports:` and put its folder on PYTHONPATH (or pip install its package)
wherever the run has a process; each component is then chosen by name like a built-in
(`learner.loss.policy_loss: cispo`, `tracking: [jsonl]`). docs/how-to/extend.md walks through it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import torch

from loopline.config import TRACKERS
from loopline.trainer.config import POLICY_LOSSES, LossConfig, Surrogate


@POLICY_LOSSES.register("cispo")
def cispo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: LossConfig) -> Surrogate:
    """CISPO (MiniMax-M1; verl's `cispo`): the ratio is clipped and detached, a weight on -A log π_θ, so a clipped
    token keeps its gradient (PPO's clip drops it)."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    weight = ratio.clamp(1 - config.clip_low, 1 + config.clip_high).detach()
    clipped = (ratio < 1 - config.clip_low) | (ratio > 1 + config.clip_high)
    return Surrogate(-weight * advantages * logp, ratio, clipped, torch.zeros_like(clipped))


@TRACKERS.register("jsonl")
class JsonLines:
    """Each ledger step's metrics as one line of `metrics.jsonl` in the run's directory."""

    def __init__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any]):
        workdir.mkdir(parents=True, exist_ok=True)
        self.file = (workdir / "metrics.jsonl").open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def artifact(self, directory: Path) -> None:
        pass

    def close(self) -> None:
        self.file.close()
