"""Advantages and losses against hand-computed values (seed §6.3, §7.3)."""

from __future__ import annotations

import math

import pytest
import torch

from loopline.trainer.advantages import AdvantageConfig, compute_advantages
from loopline.trainer.losses import LossConfig, aggregate, kl_penalty, logprob_gap, policy_loss


def _adv(rewards, groups=None, **kw):
    return compute_advantages(rewards, groups or ["g"] * len(rewards), AdvantageConfig(**kw))


def test_grpo_seed_case_population_std():
    a = _adv([1, 0, 1, 0])
    assert a.values.tolist() == pytest.approx([1, -1, 1, -1], abs=1e-5)  # mean 0.5, population std 0.5


def test_grpo_sample_std_and_mean_only_and_rloo():
    # sample std of [1,0,1,0] = sqrt(1/3) = 0.57735; 0.5 / 0.57735 = 0.86603
    assert _adv([1, 0, 1, 0], std="sample").values.tolist() == pytest.approx([0.86603, -0.86603] * 2, abs=1e-5)
    assert _adv([1, 0, 1, 0], estimator="dr_grpo").values.tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5])
    # RLOO: 1 - mean(0,1,0) = 2/3 ; 0 - mean(1,1,0) = -2/3
    assert _adv([1, 0, 1, 0], estimator="rloo").values.tolist() == pytest.approx([2 / 3, -2 / 3] * 2)
    # groups are normalised separately: [3, 1] -> mean 2, std 1
    a = _adv([3, 1, 1, 0], groups=["a", "a", "b", "b"])
    assert a.values.tolist() == pytest.approx([1, -1, 1, -1], abs=1e-5) and a.groups == 2


def test_zero_variance_groups_are_flagged_and_zeroed_or_dropped():
    kept = _adv([1, 1, 0, 1], groups=["a", "a", "b", "b"])
    assert kept.degenerate_groups == 1 and kept.values[:2].tolist() == [0, 0] and kept.keep.all()
    dropped = _adv([1, 1, 0, 1], groups=["a", "a", "b", "b"], degenerate="drop")
    assert dropped.keep.tolist() == [False, False, True, True]


def test_bad_rewards_are_refused():
    with pytest.raises(ValueError, match="NaN or inf"):
        _adv([1.0, float("nan")])
    with pytest.raises(ValueError, match="empty batch"):
        _adv([])


def _t(*values):
    return torch.tensor([list(values)], dtype=torch.float64)


def test_behaviour_policy_is_kept_apart_from_the_recomputed_one():
    """μ = 0.20, π_θ = 0.24: the off-policy ratio is 1.2. A recomputed 0.23 in the denominator gives 1.043."""
    logp, old, mu, mask, adv = _t(math.log(0.24)), _t(math.log(0.23)), _t(math.log(0.20)), _t(1), torch.tensor([1.0], dtype=torch.float64)
    wide = dict(clip_low=0.9, clip_high=9.0, correction_cap=100.0)
    right = policy_loss(logp, old, mu, adv, mask, LossConfig(correction="tis", **wide))
    assert float(right.loss) == pytest.approx(-1.2)  # (π_old/μ)·(π_θ/π_old) = π_θ/μ
    bug = policy_loss(logp, old, old, adv, mask, LossConfig(correction="none", **wide))
    assert float(bug.loss) == pytest.approx(-0.24 / 0.23) and float(bug.loss) == pytest.approx(-1.0435, abs=1e-4)


def test_ppo_clip_is_asymmetric_and_pessimistic():
    mask = _t(1)
    up = policy_loss(_t(math.log(1.5)), _t(0.0), _t(0.0), torch.tensor([1.0], dtype=torch.float64), mask, LossConfig(clip_high=0.28, correction="none"))
    assert float(up.loss) == pytest.approx(-1.28) and up.metrics["clip_fraction"] == 1.0
    down = policy_loss(_t(math.log(0.5)), _t(0.0), _t(0.0), torch.tensor([-1.0], dtype=torch.float64), mask, LossConfig(clip_low=0.2, correction="none"))
    assert float(down.loss) == pytest.approx(0.8)  # min(-0.5, -0.8) = -0.8 -> loss 0.8
    inside = policy_loss(_t(math.log(1.1)), _t(0.0), _t(0.0), torch.tensor([1.0], dtype=torch.float64), mask, LossConfig(correction="none"))
    assert float(inside.loss) == pytest.approx(-1.1) and inside.metrics["clip_fraction"] == 0.0


def test_tis_truncates_and_mis_masks_large_behaviour_ratios():
    logp = old = _t(math.log(0.3))
    mu = _t(math.log(0.1))  # π_old / μ = 3
    adv = torch.tensor([1.0], dtype=torch.float64)
    tis = policy_loss(logp, old, mu, adv, _t(1), LossConfig(correction="tis", correction_cap=2.0))
    mis = policy_loss(logp, old, mu, adv, _t(1), LossConfig(correction="mis", correction_cap=2.0))
    assert float(tis.loss) == pytest.approx(-2.0) and float(mis.loss) == pytest.approx(0.0)
    assert tis.metrics["correction_capped_fraction"] == 1.0


def test_aggregation_weights_a_short_and_a_long_trajectory_differently():
    per_token = torch.zeros(2, 200, dtype=torch.float64)
    mask = torch.zeros(2, 200)
    per_token[0, :20], mask[0, :20] = 1.0, 1  # a 20-token trajectory with per-token loss 1
    mask[1, :200] = 1  # a 200-token trajectory with per-token loss 0
    assert float(aggregate(per_token, mask, "token_mean")) == pytest.approx(20 / 220)
    assert float(aggregate(per_token, mask, "seq_mean_token_sum")) == pytest.approx(10.0)
    assert float(aggregate(per_token, mask, "seq_mean_token_mean")) == pytest.approx(0.5)


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1)


def test_masked_tokens_do_not_count_and_gradients_reach_only_the_policy():
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    mu = torch.tensor([[math.log(0.5), float("nan")]], dtype=torch.float64)  # NaN under mask 0 is ignored
    out = policy_loss(logp, logp.detach(), mu, torch.tensor([2.0], dtype=torch.float64), torch.tensor([[1, 0]]), LossConfig())
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(-2.0) and logp.grad[0, 1] == 0 and logp.grad[0, 0] == pytest.approx(-2.0)


def test_nan_on_action_tokens_refuses_the_update():
    with pytest.raises(ValueError, match="behaviour_logp has NaN"):
        policy_loss(_t(0.0), _t(0.0), _t(float("nan")), torch.tensor([1.0]), _t(1))


def test_logprob_gap():
    gap = logprob_gap(_t(-1.0, -2.0), _t(-1.1, -2.0), _t(1, 1))
    assert gap["logprob_abs_diff"] == pytest.approx(0.05)
    assert gap["logprob_kl"] == pytest.approx((math.exp(0.1) - 0.1 - 1) / 2)


@pytest.mark.parametrize("how", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_micro_batch_shares_add_up_to_the_whole_batch_loss(how):
    torch.manual_seed(0)
    per_token = torch.randn(5, 7, dtype=torch.float64)
    mask = (torch.rand(5, 7) > 0.3).long()
    mask[2] = 0  # a sequence without action tokens counts for nothing
    whole = aggregate(per_token, mask, how)
    tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    parts = [aggregate(per_token[r], mask[r], how, tokens, seqs) for r in (slice(0, 2), slice(2, 5))]
    assert float(sum(parts)) == pytest.approx(float(whole))


def test_learning_rate_schedule_by_hand():
    from loopline.trainer.schedule import lr_factor

    assert [lr_factor(s, warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # cosine from 1.0 to 0.1 over 10 steps: halfway 0.1 + 0.9 * 0.5 * (1 + cos(pi / 2)) = 0.55
    assert lr_factor(0, decay_steps=10) == 1.0
    assert abs(lr_factor(5, decay_steps=10) - 0.55) < 1e-12
    assert abs(lr_factor(10, decay_steps=10) - 0.1) < 1e-12 and abs(lr_factor(30, decay_steps=10) - 0.1) < 1e-12
    # warm-up then decay: the decay starts where warm-up ends
    assert lr_factor(1, warmup_steps=2, decay_steps=12) == 1.0 and lr_factor(2, warmup_steps=2, decay_steps=12) == 1.0
