"""Advantages and losses against hand-computed values (seed §6.3, §7.3)."""

from __future__ import annotations

import math

import pytest
import torch

from loopline.trainer.advantages import advantage_settings, compute_advantages
from loopline.trainer.losses import aggregate, kl_penalty, logprob_gap, loss_settings, policy_loss


def _adv(rewards, groups=None, **kw):
    return compute_advantages(rewards, groups or ["g"] * len(rewards), advantage_settings(**kw))


def test_grpo_seed_case_population_std():
    a = _adv([1, 0, 1, 0], std="population")
    assert a.values.tolist() == pytest.approx([1, -1, 1, -1], abs=1e-5)  # mean 0.5, population std 0.5


def test_grpo_sample_std_and_mean_only_and_rloo():
    # sample std of [1,0,1,0] = sqrt(1/3) = 0.57735; 0.5 / 0.57735 = 0.86603
    assert _adv([1, 0, 1, 0], std="sample").values.tolist() == pytest.approx([0.86603, -0.86603] * 2, abs=1e-5)
    assert _adv([1, 0, 1, 0], estimator="dr_grpo").values.tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5])
    # RLOO: 1 - mean(0,1,0) = 2/3 ; 0 - mean(1,1,0) = -2/3
    assert _adv([1, 0, 1, 0], estimator="rloo").values.tolist() == pytest.approx([2 / 3, -2 / 3] * 2)
    # groups are normalised separately: [3, 1] -> mean 2, population std 1
    a = _adv([3, 1, 1, 0], groups=["a", "a", "b", "b"], std="population")
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
    right = policy_loss(logp, old, mu, adv, mask, loss_settings(correction="tis", **wide))
    assert float(right.loss) == pytest.approx(-1.2)  # (π_old/μ)·(π_θ/π_old) = π_θ/μ
    bug = policy_loss(logp, old, old, adv, mask, loss_settings(correction="none", **wide))
    assert float(bug.loss) == pytest.approx(-0.24 / 0.23) and float(bug.loss) == pytest.approx(-1.0435, abs=1e-4)


def test_ppo_clip_is_asymmetric_and_pessimistic():
    mask = _t(1)
    up = policy_loss(_t(math.log(1.5)), _t(0.0), _t(0.0), torch.tensor([1.0], dtype=torch.float64), mask, loss_settings(clip_high=0.28, correction="none"))
    assert float(up.loss) == pytest.approx(-1.28) and up.metrics["clip_fraction"] == 1.0
    down = policy_loss(_t(math.log(0.5)), _t(0.0), _t(0.0), torch.tensor([-1.0], dtype=torch.float64), mask, loss_settings(clip_low=0.2, correction="none"))
    assert float(down.loss) == pytest.approx(0.8)  # min(-0.5, -0.8) = -0.8 -> loss 0.8
    inside = policy_loss(_t(math.log(1.1)), _t(0.0), _t(0.0), torch.tensor([1.0], dtype=torch.float64), mask, loss_settings(correction="none"))
    assert float(inside.loss) == pytest.approx(-1.1) and inside.metrics["clip_fraction"] == 0.0


def test_tis_truncates_and_mis_masks_large_behaviour_ratios():
    logp = old = _t(math.log(0.3))
    mu = _t(math.log(0.1))  # π_old / μ = 3
    adv = torch.tensor([1.0], dtype=torch.float64)
    tis = policy_loss(logp, old, mu, adv, _t(1), loss_settings(correction="tis", correction_cap=2.0))
    mis = policy_loss(logp, old, mu, adv, _t(1), loss_settings(correction="mis", correction_cap=2.0))
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
    # the reference 15 nats likelier than the policy: k3 = e^15 - 15 - 1 ~ 3.3e6, capped at 10 as verl's low_var_kl
    far = kl_penalty(torch.tensor([-16.0]), torch.tensor([-1.0]), "k3")
    assert float(far) == 10.0


def test_masked_tokens_do_not_count_and_gradients_reach_only_the_policy():
    logp = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    mu = torch.tensor([[math.log(0.5), float("nan")]], dtype=torch.float64)  # NaN under mask 0 is ignored
    out = policy_loss(logp, logp.detach(), mu, torch.tensor([2.0], dtype=torch.float64), torch.tensor([[1, 0]]), loss_settings())
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(-2.0) and logp.grad[0, 1] == 0 and logp.grad[0, 0] == pytest.approx(-2.0)


def test_nan_on_action_tokens_refuses_the_update():
    with pytest.raises(ValueError, match="behaviour_logp has NaN"):
        policy_loss(_t(0.0), _t(0.0), _t(float("nan")), torch.tensor([1.0]), _t(1))


def test_logprob_gap():
    gap = logprob_gap(_t(-1.0, -2.0), _t(-1.1, -2.0), _t(1, 1))
    assert gap["logprob_abs_diff"] == pytest.approx(0.05)
    assert gap["logprob_kl"] == pytest.approx((math.exp(0.1) - 0.1 - 1) / 2)


@pytest.mark.parametrize("how", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batch_shares_add_up_to_the_whole_batch_loss(how):
    torch.manual_seed(0)
    per_token = torch.randn(5, 7, dtype=torch.float64)
    mask = (torch.rand(5, 7) > 0.3).long()
    mask[2] = 0  # a sequence without action tokens counts for nothing
    config = loss_settings(aggregation=how, **({"norm_length": 16} if how == "seq_mean_token_sum_norm" else {}))
    whole = aggregate(per_token, mask, config)
    tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    parts = [aggregate(per_token[r], mask[r], config, tokens, seqs) for r in (slice(0, 2), slice(2, 5))]
    assert float(sum(parts)) == pytest.approx(float(whole))


def test_learning_rate_schedule_by_hand():
    from functools import partial

    from loopline.trainer.schedule import lr_factor

    assert [lr_factor(s, warmup_steps=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    # cosine from 1.0 to 0.1 over 10 steps (the starter's recipe): halfway 0.1 + 0.9 * 0.5 * (1 + cos(pi / 2)) = 0.55
    cosine = partial(lr_factor, schedule="cosine", decay_steps=10, min_ratio=0.1)
    assert cosine(0) == 1.0 and abs(cosine(5) - 0.55) < 1e-12
    assert abs(cosine(10) - 0.1) < 1e-12 and abs(cosine(30) - 0.1) < 1e-12
    # verl's and TRL's cosine ends at 0: a quarter of the way cos(pi/4): 0.5 * (1 + 0.70711) = 0.85355
    assert abs(lr_factor(2, schedule="cosine", decay_steps=8) - 0.5 * (1 + math.cos(math.pi / 4))) < 1e-12
    # linear to 0 over 8 steps: 1, 7/8, ..., 0 (TRL's default "linear")
    assert [lr_factor(s, schedule="linear", decay_steps=8) for s in (0, 1, 4, 8, 9)] == [1.0, 0.875, 0.5, 0.0, 0.0]
    # warm-up then decay: the decay starts where warm-up ends (warm-up 2, then 10 steps of linear decay)
    assert [lr_factor(s, warmup_steps=2, schedule="linear", decay_steps=12) for s in (0, 1, 2, 7, 12)] == [0.5, 1.0, 1.0, 0.5, 0.0]


# --------------------------------------------------------------------------- issue 15: off-policy correction,
# dual clip, bounded log-ratios, Dr. GRPO's constant normaliser (hand-computed)

ONE = torch.tensor([1.0], dtype=torch.float64)


def _ratios(*rho):
    """old = log ρ, μ = 0: π_old/μ = ρ per token; π_θ = π_old (ratio 1), so each token's surrogate loss is -A."""
    return _t(*[math.log(r) for r in rho]), _t(*[0.0] * len(rho))


def test_mis_weights_kept_tokens_by_the_ratio_and_rejects_the_rest():
    old, mu = _ratios(1.5, 3.0)  # C = 2: the first is kept with weight 1.5, the second rejected
    mask = _t(1, 1)
    mis = policy_loss(old, old, mu, ONE, mask, loss_settings(correction="mis", correction_cap=2.0, clip_ratio_c=None))
    assert float(mis.loss) == pytest.approx(-1.5)  # (-1 * 1.5) / 1 kept token: the rejected one left the denominator
    assert mis.metrics["rejected_fraction"] == 0.5 and mis.metrics["correction_weight_mean"] == pytest.approx(1.5)
    pure = policy_loss(old, old, mu, ONE, mask, loss_settings(correction="rejection", correction_cap=2.0))
    assert float(pure.loss) == pytest.approx(-1.0)  # verl's pure rejection: kept tokens weigh 1
    tis = policy_loss(old, old, mu, ONE, mask, loss_settings(correction="tis", correction_cap=2.0))
    assert float(tis.loss) == pytest.approx((-1.5 - 2.0) / 2)  # nothing rejected, 3 truncated to 2


def test_two_sided_bounds_reject_ratios_below_one_over_c():
    old, mu = _ratios(0.4, 1.0)  # 1/C = 0.5
    upper = policy_loss(old, old, mu, ONE, _t(1, 1), loss_settings(correction="mis", correction_cap=2.0))
    both = policy_loss(old, old, mu, ONE, _t(1, 1), loss_settings(correction="mis", correction_cap=2.0, correction_bounds="two_sided"))
    assert float(upper.loss) == pytest.approx((-0.4 - 1.0) / 2) and float(both.loss) == pytest.approx(-1.0)


def test_sequence_level_mis_uses_the_product_of_the_token_ratios():
    # sequence 0: 1.5 * 1.5 = 2.25 > C = 2, rejected whole; sequence 1: 1.2 * 0.9 = 1.08, both tokens weigh 1.08
    old = torch.tensor([[math.log(1.5), math.log(1.5)], [math.log(1.2), math.log(0.9)]], dtype=torch.float64)
    mu = torch.zeros(2, 2, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    cfg = loss_settings(correction="mis", correction_level="sequence", correction_cap=2.0)
    out = policy_loss(old, old, mu, adv, torch.ones(2, 2), cfg)
    assert float(out.loss) == pytest.approx(-1.08) and out.metrics["rejected_fraction"] == 0.5
    seq_mean = policy_loss(old, old, mu, adv, torch.ones(2, 2), loss_settings(correction="mis", correction_level="sequence", aggregation="seq_mean_token_sum"))
    assert float(seq_mean.loss) == pytest.approx(-2 * 1.08)  # one sequence left: the rejected one is out of the count


def test_rejected_tokens_carry_no_kl_term():
    old, mu = _ratios(1.0, 3.0)
    ref = _t(math.log(0.5), math.log(0.5))  # KL k1 per token = log π_θ - log π_ref = 0 - log 0.5 = log 2 on both
    cfg = loss_settings(correction="mis", correction_cap=2.0, kl_coef=0.1, kl_estimator="k1")
    out = policy_loss(old, old, mu, ONE, _t(1, 1), cfg, ref_logp=ref)
    assert float(out.loss) == pytest.approx(-1.0 + 0.1 * math.log(2))  # only the kept token: surrogate and KL


def test_dual_clip_caps_the_loss_of_negative_advantages_with_no_gradient():
    logp = torch.tensor([[math.log(5.0)]], dtype=torch.float64, requires_grad=True)  # r = 5
    zero = _t(0.0)
    out = policy_loss(logp, zero, zero, -ONE, _t(1), loss_settings(correction="none"))  # c = 3 by default (verl)
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(3.0) and float(logp.grad) == 0.0 and out.metrics["dual_clip_fraction"] == 1.0
    off = policy_loss(logp.detach(), zero, zero, -ONE, _t(1), loss_settings(correction="none", clip_ratio_c=None))
    assert float(off.loss) == pytest.approx(5.0)  # max(5, 1.28): the unbounded PPO loss
    positive = policy_loss(logp.detach(), zero, zero, ONE, _t(1), loss_settings(correction="none"))
    assert float(positive.loss) == pytest.approx(-1.28)  # A > 0: the ordinary clip, dual clip does not apply
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        loss_settings(clip_ratio_c=1.0)


def test_gspo_clips_the_geometric_mean_of_a_rows_token_ratios_by_hand():
    """Token ratios 1.21 and 1 (a third token off the mask, ratio e^5): s = sqrt(1.21 * 1) = 1.1 for the whole row,
    where vanilla clips each token's own. A = 1, token mean: loss -1.1, each token's gradient -s/2 = -0.55 (vanilla:
    -1.105, gradients -0.605 and -0.5)."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    for mode, loss, grads in (("gspo", -1.1, [-0.55, -0.55]), ("vanilla", -1.105, [-0.605, -0.5])):
        logp = torch.tensor([[math.log(1.21), 0.0, 5.0]], dtype=torch.float64, requires_grad=True)
        out = policy_loss(logp, old, old, ONE, mask, loss_settings(policy_loss=mode, correction="none"))
        out.loss.backward()
        assert float(out.loss.detach()) == pytest.approx(loss) and logp.grad[0, :2].tolist() == pytest.approx(grads), mode
        assert float(logp.grad[0, 2]) == 0.0
    assert out.metrics["ratio_mean"] == pytest.approx((1.21 + 1.0) / 2)
    # s = e^(ln 4) = 4: above 1 + 0.28 with A = 1 the clip holds (-1.28, no gradient); with A = -1 GSPO has no
    # dual clip (loss 4, where vanilla's c = 3 caps each token at 3)
    logp = torch.tensor([[math.log(4.0), math.log(4.0)]], dtype=torch.float64, requires_grad=True)
    zeros, both = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    up = policy_loss(logp, zeros, zeros, ONE, both, loss_settings(policy_loss="gspo", correction="none"))
    (grad,) = torch.autograd.grad(up.loss, logp)
    assert float(up.loss.detach()) == pytest.approx(-1.28) and grad.abs().sum() == 0 and up.metrics["clip_fraction"] == 1.0
    down = policy_loss(logp, zeros, zeros, -ONE, both, loss_settings(policy_loss="gspo", correction="none"))
    assert float(down.loss.detach()) == pytest.approx(4.0) and down.metrics["dual_clip_fraction"] == 0.0
    vanilla = policy_loss(logp, zeros, zeros, -ONE, both, loss_settings(correction="none"))
    assert float(vanilla.loss.detach()) == pytest.approx(3.0)


def test_an_unknown_policy_loss_is_refused_with_the_names_there_are():
    with pytest.raises(ValueError, match="unknown policy loss 'gpso'; did you mean gspo"):
        loss_settings(policy_loss="gpso")


@pytest.mark.parametrize("log_ratio", [25.0, -25.0, 100.0])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_log_ratios_give_finite_losses_and_gradients_in_float32(log_ratio, sign):
    """exp(100) is inf in float32: unclamped, the gradient is NaN even where the loss is finite (clamp at ±20, as verl)."""
    logp = torch.tensor([[log_ratio]], dtype=torch.float32, requires_grad=True)
    zero = torch.zeros(1, 1, dtype=torch.float32)
    for cfg in (loss_settings(correction="none", clip_ratio_c=None), loss_settings(correction="mis", kl_coef=0.1), loss_settings()):
        out = policy_loss(logp, zero, zero, torch.tensor([sign]), torch.ones(1, 1), cfg, ref_logp=zero)
        (grad,) = torch.autograd.grad(out.loss, logp)
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all(), (cfg, float(out.loss), grad)


def test_seq_mean_token_sum_norm_divides_by_a_constant_length():
    per_token = torch.zeros(2, 200, dtype=torch.float64)
    mask = torch.zeros(2, 200)
    per_token[0, :20], mask[0, :20] = 1.0, 1
    mask[1, :200] = 1
    # token sums 20 and 0 over (2 sequences x L = 400): whatever the batch's own lengths
    assert float(aggregate(per_token, mask, loss_settings(aggregation="seq_mean_token_sum_norm", norm_length=400))) == pytest.approx(20 / 800)
    with pytest.raises(ValueError, match="needs norm_length"):
        aggregate(per_token, mask, "seq_mean_token_sum_norm")


def test_grpo_default_is_the_sample_std_of_verl_and_trl():
    # group size 2, rewards [1, 0]: sample std 0.70711 -> advantages ±0.70711 (population std would give ±1, x1.41)
    assert _adv([1, 0]).values.tolist() == pytest.approx([0.70711, -0.70711], abs=1e-5)
    assert _adv([1, 0], std="population").values.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    assert _adv([1, 1]).values.tolist() == [0.0, 0.0] and _adv([1, 1]).degenerate_groups == 1  # all equal: no signal
    assert _adv([1.0], groups=["solo"]).degenerate_groups == 1  # one sample: no std at all


def test_an_all_rejected_batch_has_zero_loss_and_no_nan():
    old, mu = _ratios(5.0, 6.0)
    out = policy_loss(old, old, mu, ONE, _t(1, 1), loss_settings(correction="mis", correction_cap=2.0))
    assert float(out.loss) == 0.0 and out.metrics["rejected_fraction"] == 1.0
    empty = policy_loss(_t(0.0), _t(0.0), _t(0.0), ONE, _t(0), loss_settings())  # a row without action tokens
    assert float(empty.loss) == 0.0


def test_a_non_finite_gradient_norm_is_refused_before_the_optimizer_steps():
    """A finite loss can have a NaN gradient (0 * inf in the backward of an unselected branch)."""
    from loopline.trainer.backends import NonFiniteGradient, TorchBackend

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = TorchBackend(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), 1.0, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]

    def loss_of(_batch):
        w = model.weight.sum()
        return torch.where(torch.tensor(True), w * 0.0, w * float("inf")), {}

    with pytest.raises(NonFiniteGradient):
        backend.optimise([None], loss_of, ValueError)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing applied
    assert not math.isfinite(backend.last_grad_norm)


def test_a_steps_metrics_combine_as_the_loss_declares_them_and_an_undeclared_one_is_refused():
    """Summed loss, maximum ratio, token-weighted means of the rest (behaviour_ratio_mean was once dropped
    silently: the learner summed a fixed list). Hand-computed over two micro-batches of 2 and 6 tokens."""
    from types import SimpleNamespace

    from loopline.trainer import losses
    from loopline.trainer.learner import Learner, LearnerError

    one_rank = SimpleNamespace(backend=SimpleNamespace(world=lambda: (1, 0)))
    from loopline.trainer.learner import OWN_TOKEN_MEANS

    base = {k: 0.0 for k in losses.TOKEN_MEANS + OWN_TOKEN_MEANS}
    micro = [
        {**base, "loss": 0.5, "tokens": 2.0, "ratio_max": 1.2, "ratio_mean": 1.0, "behaviour_ratio_mean": 1.0, "clip_fraction": 0.5},
        {**base, "loss": 0.25, "tokens": 6.0, "ratio_max": 3.0, "ratio_mean": 2.0, "behaviour_ratio_mean": 1.5, "clip_fraction": 0.0,
         "entropy": 2.0},
    ]
    summary = Learner._summarise(one_rank, micro)
    assert summary["loss"] == pytest.approx(0.75) and summary["ratio_max"] == 3.0
    assert summary["ratio_mean"] == pytest.approx((2 * 1.0 + 6 * 2.0) / 8)
    assert summary["behaviour_ratio_mean"] == pytest.approx((2 * 1.0 + 6 * 1.5) / 8)
    assert summary["clip_fraction"] == pytest.approx(2 * 0.5 / 8) and summary["entropy"] == pytest.approx(6 * 2.0 / 8)
    assert set(summary) == {"loss", "ratio_max", *losses.TOKEN_MEANS, *OWN_TOKEN_MEANS}
    with pytest.raises(LearnerError, match="does not declare: perplexity"):
        Learner._summarise(one_rank, [{**micro[0], "perplexity": 1.0}])
    # and what the loss returns is exactly what it declares
    mask = torch.tensor([[1.0]])
    returned = policy_loss(_t(0.1), _t(0.0), _t(0.0), torch.tensor([1.0], dtype=torch.float64), mask, loss_settings(kl_coef=0.1), ref_logp=_t(0.0))
    assert set(returned.metrics) == {*losses.SUMMED, *losses.MAXIMA, *losses.TOKEN_MEANS}


def test_a_steps_batch_metrics_by_hand():
    """Two trajectories of 6 and 4 tokens, 3 and 1 of them generated, through the learner in 2 s: 2 generated
    tokens per trajectory on average, 3 at most, (6 + 4) / 2 = 5 tokens per second."""
    from loopline.trainer.batch import TrainSequence, batch_metrics

    def seq(mask: tuple[int, ...]) -> TrainSequence:
        return TrainSequence(None, 0, 1.0, tuple(range(len(mask))), mask, tuple(0.0 for _ in mask))

    assert batch_metrics([seq((0, 0, 0, 1, 1, 1)), seq((0, 0, 0, 1))], 2.0) == {
        "response_length/mean": 2.0, "response_length/max": 3.0, "perf/tokens_per_s": 5.0,
    }


def test_token_entropy_by_hand():
    """H = -Σ p ln p: uniform over 4 is ln 4; p = (1/4, 3/4) is 0.5623; one sure token is 0."""
    from loopline.trainer.head import token_entropy

    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(1.0), math.log(3.0), -math.inf, -math.inf], [0.0, -1e4, -1e4, -1e4]])
    expected = [math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), 0.0]
    assert token_entropy(logits).tolist() == pytest.approx(expected, abs=1e-6)


def test_reward_std_is_trls_mean_of_each_groups_sample_std_by_hand():
    """Groups [1, 0] (sample std 1/√2 = 0.70711) and [1, 1, 0, 0] (√(1/3) = 0.57735): 0.64223. A group of one has none."""
    from loopline.trainer.batch import TrainSequence
    from loopline.trainer.learner import _mean_group_std

    rows = [("a", 1.0), ("a", 0.0), ("b", 1.0), ("b", 1.0), ("b", 0.0), ("b", 0.0), ("c", 1.0)]
    firsts = [TrainSequence(None, group, reward, (1, 2), (0, 1), (0.0, -1.0)) for group, reward in rows]
    assert _mean_group_std(firsts) == pytest.approx((2 ** -0.5 + (1 / 3) ** 0.5) / 2)


def test_micro_batches_keep_the_rows_that_share_a_prompt_together_within_the_budget():
    """The learner runs a shared prompt once per micro-batch (trainer/prefix.py). By hand: prompts A (3 tokens) and
    B (4), two samples each, interleaved in length (A 5, B 6, A 7, B 8 tokens). Sorted by length alone, a budget of 16
    padded tokens made [A, B], [A, B]: each prompt run twice."""
    from loopline.trainer.batch import TrainSequence, micro_batches, prompt_length

    def row(prompt, actions, group):
        return TrainSequence(None, group, 0.0, list(prompt) + [9] * actions, [0] * len(prompt) + [1] * actions, [0.0] * (len(prompt) + actions))

    a, b = (1, 2, 3), (4, 5, 6, 7)
    rows = [row(a, 2, "a"), row(b, 2, "b"), row(a, 4, "a"), row(b, 4, "b")]  # 5, 6, 7, 8 tokens
    assert [prompt_length(r) for r in rows] == [3, 4, 3, 4]
    assert micro_batches(rows, 16) == [[0, 2], [1, 3]]  # A's rows (padded: 2 x 7), then B's (2 x 8)
    assert micro_batches(rows, 14) == [[0, 2], [1], [3]]  # (B's two rows padded are 16 tokens: never over the budget)
    assert micro_batches(rows, 100) == [[0, 2, 1, 3]]
    # rows that share no prompt keep the length order (the least padding)
    assert micro_batches([row((k,), n, k) for k, n in enumerate((4, 1, 3))], 100) == [[1, 2, 0]]
    # with the prompt run once (share_prefix), a micro-batch counts each prompt once (minus its last token, which the
    # suffix runs) and each row's suffix: A's rows 2 + 3 + 5 = 10 tokens, B's 3 + 3 + 5 = 11, all four 21
    assert micro_batches(rows, 12) == [[0], [2], [1], [3]]  # (padded: A's two rows are 14)
    assert micro_batches(rows, 12, share_prefix=True) == [[0, 2], [1, 3]]
    assert micro_batches(rows, 21) == [[0, 2, 1], [3]]  # (padded: 3 x 7, then 4 x 8)
    assert micro_batches(rows, 21, share_prefix=True) == [[0, 2, 1, 3]]
    assert micro_batches([row((k,), n, k) for k, n in enumerate((4, 1, 3))], 100, share_prefix=True) == [[1, 2, 0]]


def test_suffix_passes_minimise_the_tokens_run_plus_a_cost_per_pass():
    """By hand, suffixes of 10, 2, 9 and 3 tokens, a pass costing 4 tokens more: one pass runs 4 x 10 + 4 = 44; the
    10 and the 9 together, then the 3 and the 2, run 2 x 10 + 4 + 2 x 3 + 4 = 34, the least (each alone: 40)."""
    from loopline.trainer.prefix import suffix_chunks

    assert suffix_chunks([10, 2, 9, 3], overhead=4) == [[0, 2], [3, 1]]
    assert suffix_chunks([10, 2, 9, 3], overhead=0) == [[0], [2], [3], [1]]  # (no padding at all)
    assert suffix_chunks([10, 2, 9, 3], overhead=100) == [[0, 2, 3, 1]]
    assert suffix_chunks([5, 5, 5], overhead=0) == [[0, 1, 2]]  # (equal lengths: one pass, nothing padded)


def test_the_head_gives_log_softmaxs_logprobs_entropy_and_gradients(monkeypatch):
    """trainer/head.py's head turns its logits into their gradient by hand. By hand, one position, two words, logits
    (1, 0), target 0: log p = 1 - log(e + 1) = -0.31326, dlogp/dz = (1 - p0, -p1) = (0.26894, -0.26894), entropy
    0.58220. Then against autograd through log_softmax on random inputs: a temperature, a bias, several chunks,
    positions left out (0 there)."""
    from loopline.trainer import head

    linear = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[1.0], [0.0]]))
    states = torch.tensor([[1.0]], requires_grad=True)
    entropy: list = []
    logp = head.states_logprobs(states, linear, torch.tensor([0]), 1.0, entropy)
    logp.sum().backward()
    assert float(logp) == pytest.approx(-0.31326, abs=1e-5) and float(entropy[0]) == pytest.approx(0.58220, abs=1e-5)
    assert float(states.grad) == pytest.approx(0.26894, abs=1e-5)  # (W^T dz: 1 x 0.26894 + 0 x -0.26894)
    assert linear.weight.grad[:, 0].tolist() == pytest.approx([0.26894, -0.26894], abs=1e-5)

    monkeypatch.setattr(head, "HEAD_CHUNK", 5)
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 50)
    states = torch.randn(3, 4, 8, requires_grad=True)
    targets, at, weights = torch.randint(0, 50, (3, 4)), torch.rand(3, 4) > 0.3, torch.randn(3, 4)
    entropy = []
    ours = head.states_logprobs(states, linear, targets, 0.7, entropy, at)
    (ours * weights).sum().backward()
    mine = (states.grad.clone(), linear.weight.grad.clone(), linear.bias.grad.clone())
    states.grad, linear.weight.grad, linear.bias.grad = None, None, None
    logits = linear(states) / 0.7
    theirs = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0] * at
    (theirs * weights).sum().backward()
    assert torch.allclose(ours, theirs, atol=1e-6) and (ours[~at] == 0).all()
    assert torch.allclose(entropy[0][at], head.token_entropy(logits)[at], atol=1e-5) and (entropy[0][~at] == 0).all()
    for got, want in zip(mine, (states.grad, linear.weight.grad, linear.bias.grad)):
        assert torch.allclose(got, want, atol=1e-6)
