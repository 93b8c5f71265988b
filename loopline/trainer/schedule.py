"""The learning-rate schedule, as a factor of `lr`: linear warm-up, then constant, or a cosine or linear decay."""

from __future__ import annotations

import math

from loopline.trainer.config import LRSchedule


def lr_factor(step: int, warmup_steps: int = 0, schedule: LRSchedule = "constant", decay_steps: int | None = None, min_ratio: float = 0.0) -> float:
    """The factor on `lr` at optimizer step `step` (0-based): (step+1)/warmup during warm-up; after it 1.0
    (constant), or a decay from 1.0 that reaches `min_ratio` at step `decay_steps` and stays there."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or decay_steps is None:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * shape
