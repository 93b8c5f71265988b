"""Token-level policy losses with three policies kept apart (seed §5, §7.3).

- μ, the behaviour policy: the logprobs the rollout engine recorded;
- π_old, this update's anchor: recomputed by the learner before its first minibatch step;
- π_θ, the policy being optimised.

Decoupled PPO clips π_θ / π_old and corrects for the rollout being off-policy
with π_old / μ, truncated at a cap (TIS) or masked out beyond it (MIS). The
classic bug this guards against is using a recomputed π in place of μ in the
importance ratio: with μ = 0.20 and π_θ = 0.24 the true ratio is 1.2, but a
recomputed 0.23 in the denominator gives 1.043 (a test).

Every tensor here is [batch, tokens] with a 0/1 `mask` marking action tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
OffPolicyCorrection = Literal["none", "tis", "mis"]
KLEstimator = Literal["k1", "k3"]


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2  # ratio floor 1 - clip_low
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high (asymmetric, "clip-higher")
    correction: OffPolicyCorrection = "tis"
    correction_cap: float = 2.0  # C: TIS truncates π_old/μ at C; MIS drops tokens above C
    aggregation: Aggregation = "token_mean"
    kl_coef: float = 0.0  # > 0 adds a KL penalty to the frozen reference policy
    kl_estimator: KLEstimator = "k3"


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    how: Aggregation,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] loss to a scalar; how each trajectory is weighted differs (see tests).

    With `total_tokens` / `total_sequences` (the whole step's counts) a micro-batch's result is its
    share of the step's loss, so the shares of all micro-batches add up to the loss of the whole batch.
    """
    per_token = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))  # padding may hold anything
    mask = mask.to(per_token.dtype)
    if how == "token_mean":  # every action token weighs the same: long trajectories weigh more
        return per_token.sum() / (total_tokens if total_tokens is not None else mask.sum().clamp(min=1))
    tokens = mask.sum(-1)
    sums = per_token.sum(-1)
    has_tokens = tokens > 0
    count = total_sequences if total_sequences is not None else has_tokens.sum().clamp(min=1)
    if how == "seq_mean_token_sum":  # each trajectory weighs its token count (unnormalised length bias)
        return sums[has_tokens].sum() / count
    if how == "seq_mean_token_mean":  # each trajectory weighs the same, whatever its length
        return (sums[has_tokens] / tokens[has_tokens]).sum() / count
    raise ValueError(f"unknown aggregation {how!r}")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from samples of π_θ (Schulman's k1 and k3)."""
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    return torch.exp(log_ratio) - log_ratio - 1


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig = LossConfig(),
    ref_logp: torch.Tensor | None = None,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
) -> LossOutput:
    """Decoupled PPO: -min(r A, clip(r) A) with r = π_θ/π_old, weighted by the π_old/μ correction.

    `advantages` is [B] (one per trajectory) or [B, T].
    """
    for name, t in (("logp", logp), ("old_logp", old_logp), ("behaviour_logp", behaviour_logp)):
        if not torch.isfinite(t[mask.bool()]).all():
            raise ValueError(f"{name} has NaN or inf on action tokens; refusing the update")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    m = mask.bool()
    zero = torch.zeros_like(logp)
    # off the action tokens (prompt, tool output, padding) values are meaningless: keep them out of the math
    logp, old_logp, behaviour_logp = (torch.where(m, t, zero) for t in (logp, old_logp, behaviour_logp))
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)

    behaviour_ratio = torch.exp(old_logp - behaviour_logp).detach()
    if config.correction == "tis":
        weight = behaviour_ratio.clamp(max=config.correction_cap)
    elif config.correction == "mis":
        weight = (behaviour_ratio <= config.correction_cap).to(logp.dtype)
    else:
        weight = torch.ones_like(behaviour_ratio)
    per_token = -weight * surrogate
    kl = torch.zeros_like(per_token)
    if config.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
        kl = kl_penalty(logp, ref_logp, config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
    loss = aggregate(per_token, mask, config.aggregation, total_tokens, total_sequences)

    with torch.no_grad():
        n = max(int(m.sum()), 1)
        clipped_tokens = ((ratio < 1 - config.clip_low) & (advantages < 0)) | ((ratio > 1 + config.clip_high) & (advantages > 0))
        metrics = {
            "loss": float(loss),
            "ratio_mean": float(ratio[m].mean()) if m.any() else 1.0,
            "ratio_max": float(ratio[m].max()) if m.any() else 1.0,
            "clip_fraction": float(clipped_tokens[m].sum()) / n,
            "behaviour_ratio_mean": float(behaviour_ratio[m].mean()) if m.any() else 1.0,
            "correction_capped_fraction": float((behaviour_ratio[m] > config.correction_cap).sum()) / n,
            "kl_ref": float(kl[m].mean()) if config.kl_coef > 0 and m.any() else 0.0,
            "tokens": float(m.sum()),
        }
    return LossOutput(loss, metrics)


def logprob_gap(recomputed: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the learner's recompute is from the rollout's logprobs (invariant 3): mean |Δ| and KL(μ || π)."""
    m = mask.bool()
    if not m.any():
        return {"logprob_abs_diff": 0.0, "logprob_kl": 0.0}
    diff = (recomputed - behaviour)[m]
    # k3 estimator of KL(μ || π) on tokens sampled from μ
    log_ratio = recomputed[m] - behaviour[m]
    return {"logprob_abs_diff": float(diff.abs().mean()), "logprob_kl": float((log_ratio.exp() - log_ratio - 1).mean())}
