"""loopline's trainer math against the reference conventions of verl and TRL, on random inputs.

Each reference below is the formula as the reference's code computes it (verl: `core_algos.py`
compute_policy_loss / agg_loss / compute_grpo_outcome_advantage and the rollout-correction helper;
TRL: GRPOTrainer's advantage, loss and KL), re-expressed in a few lines, in float64. Each test names
the reference setting it reproduces and the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from loopline.trainer.advantages import advantage_settings, compute_advantages
from loopline.trainer.losses import aggregate, loss_settings, kl_penalty, policy_loss

B, T = 6, 9


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6  # ratios from ~0.2 to ~5
    behaviour = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    mask[:, 0] = 1  # every row has an action token (verl's seq means count every row)
    return logp, old, behaviour, adv, mask


def _verl_pg_losses(logp, old, adv, low=0.2, high=0.28, c=3.0):
    """verl compute_policy_loss (vanilla): clamp log-ratio ±20, PPO clip, dual clip for A < 0."""
    a = adv[:, None].expand_as(logp)
    ratio = torch.exp((logp - old).clamp(-20, 20))
    clip1 = torch.maximum(-a * ratio, -a * ratio.clamp(1 - low, 1 + high))
    return torch.where(a < 0, torch.minimum(-a * c, clip1), clip1)


def _verl_agg(loss, mask, mode):
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / mask.sum(-1)).mean()
    raise ValueError(mode)


@pytest.mark.parametrize(
    "ours, verl",
    [("token_mean", "token-mean"), ("seq_mean_token_sum", "seq-mean-token-sum"), ("seq_mean_token_mean", "seq-mean-token-mean")],
)
@pytest.mark.parametrize("seed", range(3))
def test_ppo_loss_with_dual_clip_equals_verl_vanilla_policy_loss(ours, verl, seed):
    """= verl `policy_loss.loss_mode=vanilla`, clip_ratio_low 0.2, clip_ratio_high 0.28, clip_ratio_c 3,
    `loss_agg_mode` as named, no rollout correction; tolerance 1e-12."""
    logp, old, behaviour, adv, mask = _inputs(seed)
    out = policy_loss(logp, old, behaviour, adv, mask, loss_settings(correction="none", aggregation=ours))
    assert float(out.loss) == pytest.approx(float(_verl_agg(_verl_pg_losses(logp, old, adv), mask, verl)), abs=1e-12)


def _verl_gspo(logp, old, adv, mask, low, high):
    """verl compute_policy_loss_gspo: s_i = exp(masked mean of log π_θ/π_old over the row), per token
    exp(clamp(logp - sg(logp) + sg(log s_i), max=10)), PPO clip (no dual clip), aggregated seq-mean-token-mean
    whatever `loss_agg_mode` says."""
    a = adv[:, None].expand_as(logp)
    m = mask.to(logp.dtype)
    seq = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    ratio = torch.exp((logp - logp.detach() + seq.detach()[:, None]).clamp(max=10.0))
    return _verl_agg(torch.maximum(-a * ratio, -a * ratio.clamp(1 - low, 1 + high)), mask, "seq-mean-token-mean")


@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
@pytest.mark.parametrize("seed", range(3))
def test_gspo_equals_verl_gspo_loss_and_gradient(clip, seed):
    """= verl `policy_loss.loss_mode=gspo` (its recipe's clip_ratio_low 3e-4, high 4e-4, and verl's defaults), which
    aggregates seq-mean-token-mean: loopline's `policy_loss: gspo, aggregation: seq_mean_token_mean`, no rollout
    correction. The loss and its gradient with respect to every log π_θ; tolerance 1e-12."""
    logp, old, behaviour, adv, mask = _inputs(seed)
    logp = (old + (logp - old) * 0.05).requires_grad_()  # sequence ratios about 1 ± 0.03: some clipped, some not
    ours = policy_loss(logp, old, behaviour, adv, mask, loss_settings(policy_loss="gspo", correction="none", aggregation="seq_mean_token_mean",
                                                               clip_low=clip[0], clip_high=clip[1]))
    (grad,) = torch.autograd.grad(ours.loss, logp)
    theirs = _verl_gspo(logp, old, adv, mask, *clip)
    (reference,) = torch.autograd.grad(theirs, logp)
    assert float(ours.loss) == pytest.approx(float(theirs), abs=1e-12)
    assert torch.allclose(grad, reference * mask, atol=1e-12, rtol=0)  # (verl's gradient is 0 off the mask too)
    assert 0 < ours.metrics["clip_fraction"] < 1 or clip[0] > 0.1


@pytest.mark.parametrize("ours, trl", [("token_mean", "bnpo"), ("seq_mean_token_mean", "grpo")])
@pytest.mark.parametrize("seed", range(3))
def test_gspo_equals_trl_sequence_level_importance_sampling(ours, trl, seed):
    """= TRL `importance_sampling_level="sequence"`, epsilon 0.2, epsilon_high 0.28, `loss_type` as named: its ratio
    is a [B, 1] exp(masked mean log-ratio) with the gradient through the mean, where GSPO-token gives each token
    s · ∂log π_θ; with one advantage per sequence (as every loopline estimator gives) the loss and the gradient
    are the same. Tolerance 1e-12."""
    logp, old, behaviour, adv, mask = _inputs(seed)
    logp = (old + (logp - old) * 0.3).requires_grad_()
    m = mask.to(logp.dtype)
    coef_1 = torch.exp(((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_2 = coef_1.clamp(1 - 0.2, 1 + 0.28)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])  # [B, 1], broadcast over the tokens
    if trl == "bnpo":
        theirs = (per_token * m).sum() / m.sum().clamp(min=1.0)
    else:
        theirs = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    ours_out = policy_loss(logp, old, behaviour, adv, mask, loss_settings(policy_loss="gspo", correction="none", aggregation=ours))
    (grad,) = torch.autograd.grad(ours_out.loss, logp)
    (reference,) = torch.autograd.grad(theirs, logp)
    assert float(ours_out.loss) == pytest.approx(float(theirs), abs=1e-12)
    assert torch.allclose(grad, reference, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_tis_equals_verl_token_level_truncated_importance_sampling(seed):
    """= verl `rollout_correction: {rollout_is: token, rollout_is_threshold: 2.0, rollout_rs: null}` (decoupled
    mode): weights min(exp(clamp(log π_old/μ, ±20)), 2) multiply the PPO token losses; tolerance 1e-12."""
    logp, old, behaviour, adv, mask = _inputs(seed)
    weights = torch.exp((old - behaviour).clamp(-20, 20)).clamp(max=2.0)
    reference = _verl_agg(_verl_pg_losses(logp, old, adv) * weights, mask, "token-mean")
    out = policy_loss(logp, old, behaviour, adv, mask, loss_settings(correction="tis", correction_cap=2.0))
    assert float(out.loss) == pytest.approx(float(reference), abs=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", range(3))
def test_two_sided_mis_equals_verl_is_weights_with_rejection(level, seed):
    """= verl `rollout_correction: {rollout_is: LEVEL, rollout_rs: LEVEL, rollout_rs_threshold: 2.0}` with the
    lower bound left to its default 1/2: IS weights ρ (mask mode: not truncated), tokens (or sequences) with
    ρ outside [1/2, 2] leave the loss mask and its denominator; tolerance 1e-12."""
    logp, old, behaviour, adv, mask = _inputs(seed)
    log_rho = torch.where(mask.bool(), old - behaviour, torch.zeros_like(old))
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(old)
    rho = torch.exp(log_rho.clamp(-20, 20))
    kept = mask.bool() & (rho >= 0.5) & (rho <= 2.0)
    reference = _verl_agg(_verl_pg_losses(logp, old, adv) * rho, kept, "token-mean")
    cfg = loss_settings(correction="mis", correction_level=level, correction_cap=2.0, correction_bounds="two_sided")
    out = policy_loss(logp, old, behaviour, adv, mask, cfg)
    assert kept.any() and float(out.loss) == pytest.approx(float(reference), abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_grpo_advantage_equals_verl_grpo_outcome_advantage(seed):
    """= verl `algorithm.adv_estimator=grpo, norm_adv_by_std_in_grpo=True` (torch.std: the sample std,
    eps 1e-6); `dr_grpo` = `norm_adv_by_std_in_grpo=False`; tolerance 1e-12. (verl gives a one-sample group
    mean 0 and std 1, i.e. its raw score; loopline needs group_size >= 2 and flags such a group.)"""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (24,), generator=g).double().tolist()
    groups = [i // 6 for i in range(24)]
    ours = compute_advantages(rewards, groups, advantage_settings()).values
    mean_only = compute_advantages(rewards, groups, advantage_settings(estimator="dr_grpo")).values
    r = torch.tensor(rewards, dtype=torch.float64).view(4, 6)
    for k in range(4):
        row = r[k]
        if bool((row == row[0]).all()):
            assert ours[k * 6 : k * 6 + 6].abs().sum() == 0  # verl gives 0 / (0 + eps) = 0 too
            continue
        assert ours[k * 6 : k * 6 + 6].tolist() == pytest.approx(((row - row.mean()) / (row.std() + 1e-6)).tolist(), abs=1e-12)
        assert mean_only[k * 6 : k * 6 + 6].tolist() == pytest.approx((row - row.mean()).tolist(), abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_seq_mean_token_sum_norm_equals_trl_dr_grpo_loss(seed):
    """= TRL `GRPOConfig(loss_type="dr_grpo", max_completion_length=L)`: (loss * mask).sum() / (B * L);
    tolerance 1e-12. verl's `seq-mean-token-sum-norm` divides the sum by L alone (no 1/B): B times larger."""
    _, _, _, _, mask = _inputs(seed)
    per_token = torch.randn(B, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    trl = (per_token * mask).sum() / (B * 32)
    assert float(aggregate(per_token, mask, loss_settings(aggregation="seq_mean_token_sum_norm", norm_length=32))) == pytest.approx(float(trl), abs=1e-12)


def test_k3_kl_equals_verl_low_var_kl_and_trl_per_token_kl():
    """= verl's `low_var_kl`: clamp(exp(clamp(ref - logp, ±20)) - (ref - logp) - 1, -10, 10), and TRL's
    `per_token_kl = exp(ref - logp) - (ref - logp) - 1` (beta > 0), which has no cap: equal below it. 1e-12."""
    logp, old, _, _, _ = _inputs(0)
    log_ratio = (old - logp).clamp(-20, 20)
    verl = torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    trl = torch.exp(old - logp) - (old - logp) - 1
    assert torch.allclose(kl_penalty(logp, old, "k3"), verl, atol=1e-12)
    assert torch.allclose(kl_penalty(logp, old, "k3"), trl, atol=1e-12) and float(trl.max()) < 10
    far = torch.tensor([-30.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)
    assert float(kl_penalty(*far, "k3")) == 10.0  # verl's cap


@pytest.mark.parametrize("seed", range(3))
def test_the_extend_pages_cispo_equals_verl_cispo_loss_and_gradient(seed, monkeypatch):
    """examples/plugins/my_components.py (docs/how-to/extend.md's plugin) = verl `policy_loss.loss_mode=cispo`:
    -sg(clip(π_θ/π_old, 1 - low, 1 + high)) A log π_θ, token-mean, no rollout correction; tolerance 1e-12."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples" / "plugins"))
    import my_components  # noqa: F401 (registers cispo)

    logp, old, behaviour, adv, mask = _inputs(seed)
    logp = logp.clone().requires_grad_()
    ratio = torch.exp((logp - old).clamp(-20, 20))
    theirs = _verl_agg(-ratio.clamp(1 - 0.2, 1 + 0.28).detach() * adv[:, None] * logp, mask, "token-mean")
    ours = policy_loss(logp, old, behaviour, adv, mask, loss_settings(policy_loss="cispo", correction="none"))
    assert float(ours.loss) == pytest.approx(float(theirs), abs=1e-12)
    (grad,) = torch.autograd.grad(ours.loss, logp)
    (reference,) = torch.autograd.grad(theirs, logp)
    assert torch.allclose(grad, reference, atol=1e-12, rtol=0) and ours.metrics["clip_fraction"] > 0
    # its own setting: lower_bound false bounds the weight above only (MiniMax-M1's ε_low large)
    above_only = policy_loss(logp, old, behaviour, adv, mask, loss_settings(policy_loss="cispo", correction="none", lower_bound=False))
    expected = _verl_agg(-ratio.clamp(max=1 + 0.28).detach() * adv[:, None] * logp, mask, "token-mean")
    assert float(above_only.loss) == pytest.approx(float(expected), abs=1e-12) and bool((ratio[mask.bool()] < 0.8).any())
