"""Group advantages (one baseline per group of samples of one task): GRPO, mean-only (Dr. GRPO), RLOO.

Inputs are per-trajectory rewards and the group each belongs to; the output
is one advantage per trajectory (the learner broadcasts it over that
trajectory's action tokens). A group whose rewards are all equal carries no
signal: it is flagged, and either dropped or kept with zero advantage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from loopline.trainer.config import ESTIMATORS, AdvantageSettings, GRPOSettings, advantage_settings


@dataclass(frozen=True)
class Advantages:
    values: torch.Tensor  # [n_trajectories], float64
    keep: torch.Tensor  # [n_trajectories] bool: False for trajectories of dropped degenerate groups
    degenerate_groups: int
    groups: int
    # per trajectory, its group's normalisation facts (stored with what was trained)
    group_mean: torch.Tensor  # [n_trajectories]
    group_std: torch.Tensor  # [n_trajectories]: the std the estimator used (0 where none)
    degenerate: torch.Tensor  # [n_trajectories] bool

    def per_sequence(self, index: Sequence[int]) -> "Advantages":
        """One row per training sequence (`index[k]`: sequence k's trajectory): every chain of a trajectory carries
        its trajectory's advantage, computed once (a two-chain episode is not two samples of its group)."""
        i = torch.as_tensor(list(index), dtype=torch.long)
        return Advantages(self.values[i], self.keep[i], self.degenerate_groups, self.groups, self.group_mean[i], self.group_std[i], self.degenerate[i])


def compute_advantages(rewards: Sequence[float], group_ids: Sequence[object], config: AdvantageSettings | None = None) -> Advantages:
    config = config or advantage_settings()
    r = torch.as_tensor(list(rewards), dtype=torch.float64)
    if r.numel() == 0:
        raise ValueError("no rewards: an empty batch has no advantages")
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf; refusing to compute advantages")
    if len(group_ids) != r.numel():
        raise ValueError(f"{r.numel()} rewards but {len(group_ids)} group ids")
    values = torch.zeros_like(r)
    means, stds = torch.zeros_like(r), torch.zeros_like(r)
    flagged = torch.zeros(r.numel(), dtype=torch.bool)
    keep = torch.ones(r.numel(), dtype=torch.bool)
    order: dict[object, list[int]] = {}
    for i, g in enumerate(group_ids):
        order.setdefault(g, []).append(i)
    degenerate = 0
    for members in order.values():
        idx = torch.tensor(members)
        group = r[idx]
        means[idx] = group.mean()
        if group.numel() < 2 or bool((group == group[0]).all()):
            degenerate += 1
            flagged[idx] = True
            if config.degenerate == "drop":
                keep[idx] = False
            continue  # zero advantage
        values[idx], stds[idx] = ESTIMATORS[config.estimator](group, config)
    return Advantages(values, keep, degenerate, len(order), means, stds, flagged)


# Each estimator: a group's rewards (at least 2, not all equal) -> (advantages, the std it divided by, 0 if none).

@ESTIMATORS.register("grpo")
def _grpo(group: torch.Tensor, config: GRPOSettings) -> tuple[torch.Tensor, torch.Tensor]:
    std = group.std(correction=0 if config.std == "population" else 1)
    return (group - group.mean()) / (std + config.eps), std


@ESTIMATORS.register("dr_grpo")
def _dr_grpo(group: torch.Tensor, config: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    return group - group.mean(), group.new_zeros(())  # mean-only: no division by the std


@ESTIMATORS.register("rloo")
def _rloo(group: torch.Tensor, config: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    # each sample's baseline is the mean of the OTHER samples of its group
    return group - (group.sum() - group) / (group.numel() - 1), group.new_zeros(())


ESTIMATORS.check_implemented()
