"""The learning-rate schedule: linear warm-up, then constant or cosine decay to 10% (as a factor of `lr`)."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup_steps: int = 0, decay_steps: int | None = None) -> float:
    """The factor on `lr` at optimizer step `step` (0-based): (step+1)/warmup during warm-up; after it,
    1.0, or with `decay_steps` a cosine from 1.0 down to 0.1 reached at step `decay_steps`."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_steps:
        progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0
