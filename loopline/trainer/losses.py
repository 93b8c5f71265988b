"""Token-level policy losses with three policies kept apart (the rollout's μ, the learner's π_old, the trained π).

- μ, the behaviour policy: the logprobs the rollout engine recorded;
- π_old, this update's anchor: recomputed by the learner before its first minibatch step;
- π_θ, the policy being optimised.

Decoupled PPO clips π_θ / π_old (per token, or per sequence with GSPO: `POLICY_LOSSES`) and corrects for the rollout being off-policy
with ρ = π_old / μ: truncated at a cap (TIS), or kept as a weight with the
tokens outside the bounds rejected (MIS), per token or per sequence. The
classic bug this guards against is using a recomputed π in place of μ in the
importance ratio: with μ = 0.20 and π_θ = 0.24 the true ratio is 1.2, but a
recomputed 0.23 in the denominator gives 1.043 (a test).

Every tensor here is [batch, tokens] with a 0/1 `mask` marking action tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopline.trainer.config import (  # noqa: F401 (re-exported)
    AGGREGATIONS, CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES, CorrectionRule, LossSettings, Surrogate, loss_settings,
)


# Log-ratios are clamped to ±20 before exp (verl's bound): in float32 exp(88.8) is inf, and an inf ratio
# gives a NaN gradient even where the loss is finite.
LOG_RATIO_BOUND = 20.0


# How the learner combines each metric `policy_loss` returns over a step's micro-batches and ranks: summed (the
# loss: each micro-batch's is its share of the step's), the maximum, or a mean weighted by the micro-batch's action
# tokens. A metric must be declared here to be recorded: the learner refuses one that is not, never drops it.
SUMMED = ("loss", "tokens")
MAXIMA = ("ratio_max",)
TOKEN_MEANS = (
    "ratio_mean", "clip_fraction", "dual_clip_fraction", "behaviour_ratio_mean", "correction_capped_fraction",
    "correction_weight_mean", "rejected_fraction", "kl_ref",
)


@AGGREGATIONS.register("token_mean")
def _token_mean(per_token: torch.Tensor, mask: torch.Tensor, total_tokens, total_sequences, sequence_tokens, config) -> torch.Tensor:
    """Every action token weighs the same: long trajectories weigh more."""
    return per_token.sum() / (total_tokens if total_tokens is not None else mask.sum().clamp(min=1))


def _sequences(per_token: torch.Tensor, mask: torch.Tensor, total_sequences) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]:
    """Per trajectory with action tokens: its token sum and token count; and the number of trajectories."""
    tokens = mask.sum(-1)
    has_tokens = tokens > 0
    count = total_sequences if total_sequences is not None else has_tokens.sum().clamp(min=1)
    return per_token.sum(-1)[has_tokens], tokens[has_tokens], count


@AGGREGATIONS.register("seq_mean_token_sum")
def _seq_mean_token_sum(per_token: torch.Tensor, mask: torch.Tensor, total_tokens, total_sequences, sequence_tokens, config) -> torch.Tensor:
    """Each trajectory weighs its token count (unnormalised length bias)."""
    sums, _, count = _sequences(per_token, mask, total_sequences)
    return sums.sum() / count


@AGGREGATIONS.register("seq_mean_token_mean")
def _seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, total_tokens, total_sequences, sequence_tokens, config) -> torch.Tensor:
    """Each trajectory weighs the same, whatever its length (and its number of chains: a chain's token sum is
    divided by all its trajectory's tokens, `sequence_tokens`, where the caller gives them)."""
    sums, tokens, count = _sequences(per_token, mask, total_sequences)
    if sequence_tokens is not None:
        tokens = sequence_tokens.to(per_token.dtype)[mask.sum(-1) > 0]
    return (sums / tokens).sum() / count


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def _seq_mean_token_sum_norm(per_token: torch.Tensor, mask: torch.Tensor, total_tokens, total_sequences, sequence_tokens, config) -> torch.Tensor:
    """Dr. GRPO: token sums over a constant length (TRL: B * max_completion_length)."""
    if config.norm_length is None:
        raise ValueError("seq_mean_token_sum_norm needs norm_length (a constant number of tokens)")
    sums, _, count = _sequences(per_token, mask, total_sequences)
    return sums.sum() / (count * config.norm_length)


AGGREGATIONS.check_implemented()  # (`loss.aggregation` by name: the functions above, registered as the config declares them)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    how: LossSettings | str,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
    sequence_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] loss to a scalar as the settings' aggregation does (`how`: its name alone); how each
    trajectory is weighted differs (see tests).

    With `total_tokens` / `total_sequences` (the whole step's counts) a micro-batch's result is its
    share of the step's loss, so the shares of all micro-batches add up to the loss of the whole batch.
    A trajectory trained as several sequences (its chains) weighs as one: `total_sequences` then counts
    trajectories, and `sequence_tokens` [B] gives each row its trajectory's tokens over all its chains.
    """
    config = loss_settings(aggregation=how) if isinstance(how, str) else how
    per_token = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))  # padding may hold anything
    mask = mask.to(per_token.dtype)
    return AGGREGATIONS[config.aggregation](per_token, mask, total_tokens, total_sequences, sequence_tokens, config)


# k3 per token is capped at 10, as verl's `low_var_kl` (kl_penalty in core_algos.py): unbounded it reaches e^20
# where the policy has left the reference far behind, and one such token would outweigh the whole batch.
K3_BOUND = 10.0

# `loss.kl_estimator` by name (Schulman's k1 and k3), each of log(π_ref / π_θ) per token.
KL_ESTIMATORS.register("k1")(lambda log_ratio: -log_ratio)
KL_ESTIMATORS.register("k3")(lambda log_ratio: (torch.exp(log_ratio) - log_ratio - 1).clamp(max=K3_BOUND))
KL_ESTIMATORS.check_implemented()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from samples of π_θ."""
    return KL_ESTIMATORS[estimator]((ref_logp - logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


@dataclass(frozen=True)
class Correction:
    """The π_old/μ correction of one micro-batch: known before the first gradient step (π_old is fixed)."""

    weight: torch.Tensor  # [B, T] multiplies each token's surrogate loss; 0 off the kept tokens
    kept: torch.Tensor  # [B, T] bool: action tokens that stay in the loss (not rejected)
    ratio: torch.Tensor  # [B, T] ρ = π_old/μ at the chosen level (1 off the action tokens)


# `loss.correction` by name (verl's rollout correction; trainer/config.CORRECTIONS declares the built-ins).
def _outside_bounds(rho: torch.Tensor, config: LossSettings) -> torch.Tensor:
    """ρ above the cap C, or (two_sided) below 1/C: `RejectionSettings`."""
    outside = rho > config.correction_cap
    return outside | (rho < 1.0 / config.correction_cap) if config.correction_bounds == "two_sided" else outside


CORRECTIONS.register("none")(CorrectionRule(lambda rho, config: torch.ones_like(rho)))
CORRECTIONS.register("tis")(CorrectionRule(lambda rho, config: rho.clamp(max=config.correction_cap)))  # truncated importance sampling
CORRECTIONS.register("mis")(CorrectionRule(lambda rho, config: rho, _outside_bounds))  # masked: weight ρ, rejected outside the bounds
CORRECTIONS.register("rejection")(CorrectionRule(lambda rho, config: torch.ones_like(rho), _outside_bounds))  # verl's rollout_rs alone
CORRECTIONS.check_implemented()


def off_policy_correction(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, config: LossSettings) -> Correction:
    m = mask.bool()
    log_rho = torch.where(m, old_logp - behaviour_logp, torch.zeros_like(old_logp)).detach()
    if config.correction_level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(old_logp)
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    rule = CORRECTIONS[config.correction]
    kept = m & ~rule.outside(rho, config) if rule.outside is not None else m.clone()
    weight = rule.weight(rho, config)
    return Correction(torch.where(kept, weight, torch.zeros_like(weight)), kept, torch.where(m, rho, torch.ones_like(rho)))


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


# GSPO's log-ratio is clamped above at 10 before exp, as verl's `compute_policy_loss_gspo` (a sequence ratio of
# e^10 already saturates any clip; below, exp underflows to 0 harmlessly).
GSPO_LOG_RATIO_MAX = 10.0


def _clip(ratio: torch.Tensor, advantages: torch.Tensor, config: LossSettings, dual_clip: float | None) -> Surrogate:
    """PPO's pessimistic clip of a ratio r: max(-r A, -clip(r, 1 - low, 1 + high) A), and for A < 0 at most
    `dual_clip` |A| (no gradient beyond)."""
    per_token = torch.maximum(-ratio * advantages, -ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * advantages)
    clipped = ((ratio < 1 - config.clip_low) & (advantages < 0)) | ((ratio > 1 + config.clip_high) & (advantages > 0))
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (per_token > cap)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
    return Surrogate(per_token, ratio, clipped, dual)


@POLICY_LOSSES.register("vanilla")
def _vanilla(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: LossSettings) -> Surrogate:
    """Each token's own ratio π_θ/π_old, clipped and dual-clipped (verl's `vanilla`, TRL's token level)."""
    return _clip(torch.exp((logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), advantages, config, config.clip_ratio_c)


@POLICY_LOSSES.register("gspo")
def _gspo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: LossSettings) -> Surrogate:
    """GSPO (Zheng et al. 2025; verl's `gspo`): a row's ratio s is the geometric mean of its tokens' ratios,
    exp(mean log π_θ/π_old over its masked tokens), one value for the whole row, so one token far off-policy
    cannot clip or inflate alone. Each token carries s with its own gradient (GSPO-token: s · π_θ/sg(π_θ)),
    clipped as PPO's, no dual clip. A row is what the learner trains: a trajectory, or one chain of one whose
    agent rewrote its history."""
    m = mask.to(logp.dtype)
    log_s = ((logp - old_logp) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp((logp - logp.detach() + log_s.detach()).clamp(max=GSPO_LOG_RATIO_MAX))
    return _clip(ratio, advantages, config, None)


POLICY_LOSSES.check_implemented()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossSettings | None = None,
    ref_logp: torch.Tensor | None = None,
    total_tokens: float | None = None,
    total_sequences: float | None = None,
    correction: Correction | None = None,
    sequence_tokens: torch.Tensor | None = None,
) -> LossOutput:
    """Decoupled PPO: the chosen surrogate (`config.policy_loss`: r = π_θ/π_old per token, or GSPO's per
    sequence, clipped), weighted by the π_old/μ correction, plus the KL term, aggregated over the tokens the
    correction keeps. `advantages` is [B] or [B, T].
    `correction` (from `off_policy_correction`) may be computed once per micro-batch by the caller, whose
    `total_tokens` / `total_sequences` must then count the kept tokens and the sequences that have any."""
    config = config or loss_settings()
    for name, t in (("logp", logp), ("old_logp", old_logp), ("behaviour_logp", behaviour_logp)):
        if not torch.isfinite(t[mask.bool()]).all():
            raise ValueError(f"{name} has NaN or inf on action tokens; refusing the update")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    m = mask.bool()
    zero = torch.zeros_like(logp)
    # off the action tokens (prompt, tool output, padding) values are meaningless: keep them out of the math
    logp, old_logp, behaviour_logp = (torch.where(m, t, zero) for t in (logp, old_logp, behaviour_logp))
    correction = correction or off_policy_correction(old_logp, behaviour_logp, mask, config)
    kept = correction.kept & m
    surrogate = POLICY_LOSSES[config.policy_loss](logp, old_logp, advantages, kept.to(logp.dtype), config)
    per_token = correction.weight * surrogate.per_token
    kl = torch.zeros_like(per_token)
    if config.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
        kl = kl_penalty(logp, ref_logp, config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
    loss = aggregate(per_token, kept, config, total_tokens, total_sequences, sequence_tokens)

    with torch.no_grad():
        n = max(int(m.sum()), 1)
        ratio = surrogate.ratio
        metrics = {
            "loss": float(loss),
            "ratio_mean": float(ratio[m].mean()) if m.any() else 1.0,
            "ratio_max": float(ratio[m].max()) if m.any() else 1.0,
            "clip_fraction": float((surrogate.clipped & m).sum()) / n,
            "dual_clip_fraction": float((surrogate.dual_clipped & kept).sum()) / n,
            "behaviour_ratio_mean": float(correction.ratio[m].mean()) if m.any() else 1.0,
            "correction_capped_fraction": float((correction.ratio[m] > config.correction_cap).sum()) / n,
            "correction_weight_mean": float(correction.weight[kept].mean()) if kept.any() else 1.0,
            "rejected_fraction": float((m & ~kept).sum()) / n,
            "kl_ref": float(kl[kept].mean()) if config.kl_coef > 0 and kept.any() else 0.0,
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
