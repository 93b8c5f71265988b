"""Issue 48, section 3: an episode of several chains (an agent that rewrote its history, or called twice at
once) is trained whole: each chain a sequence, the episode's advantage computed once, and under sequence-level
losses the episode weighs as one sequence. Hand-computed cases."""

from __future__ import annotations

import uuid

import pytest
import torch

from loopline.trainer.advantages import advantage_settings, compute_advantages
from loopline.trainer.batch import TrainSequence, batch_metrics, sequences_from_trajectory, trajectory_index
from loopline.trainer.losses import aggregate
from loopline.types import StoredSegment, StoredTrajectory, TrainedSample, chains, first_chain_break


def _seg(seq, prompt, generated, starts_chain=False):
    return StoredSegment(seq, tuple(prompt), tuple(generated), (1,) * len(generated), tuple(-0.1 * (i + 1) for i in range(len(generated))), starts_chain)


# chain 1: [1 2] -> [3], then [1 2 3 9] -> [4 5]; chain 2 (the history rewritten): [7] -> [8]
TWO_CHAINS = (_seg(0, [1, 2], [3]), _seg(1, [1, 2, 3, 9], [4, 5]), _seg(2, [7], [8], starts_chain=True))


def test_a_break_is_allowed_only_where_a_segment_starts_a_chain():
    assert first_chain_break(TWO_CHAINS) is None
    unmarked = (*TWO_CHAINS[:2], _seg(2, [7], [8]))
    assert first_chain_break(unmarked) == 2  # (re-tokenised history is still refused)
    assert [[s.seq for s in c] for c in chains(TWO_CHAINS)] == [[0, 1], [2]]


def test_each_chain_is_one_sequence_with_its_own_tokens_masks_and_logprobs():
    t = StoredTrajectory(uuid.uuid4(), "g", 1.0, 3, 3, TWO_CHAINS)
    first, second = sequences_from_trajectory(t)
    assert first.input_ids.tolist() == [1, 2, 3, 9, 4, 5] and first.action_mask.tolist() == [0, 0, 1, 0, 1, 1]
    assert first.behaviour_logprobs.tolist() == pytest.approx((0, 0, -0.1, 0, -0.1, -0.2))
    assert second.input_ids.tolist() == [7, 8] and second.action_mask.tolist() == [0, 1]
    assert second.behaviour_logprobs.tolist() == pytest.approx((0, -0.1))
    assert (first.chain, second.chain) == (0, 1) and first.trajectory_id == second.trajectory_id == t.id
    assert trajectory_index([first, second, *sequences_from_trajectory(StoredTrajectory(uuid.uuid4(), "g", 0.0, 3, 3, TWO_CHAINS[:1]))]) == [0, 0, 1]
    # generated tokens per trajectory: its chains together (3 + 1), and the other's 1
    assert batch_metrics([first, second, TrainSequence(None, "g", 0.0, (1, 2), (0, 1), (0.0, -1.0))], 1.0)["response_length/mean"] == 2.5
    with pytest.raises(ValueError, match="does not follow"):
        trajectory_index([second])


def test_a_trajectorys_advantage_is_computed_once_whatever_its_chains():
    # group g: rewards 1 (two chains) and 0 (one chain). Per trajectory: mean 0.5, population std 0.5: +1 and -1.
    # Counting chains as samples would give mean 2/3 and other advantages.
    adv = compute_advantages([1.0, 0.0], ["g", "g"], advantage_settings(std="population")).per_sequence([0, 0, 1])
    assert adv.values.tolist() == pytest.approx([1.0, 1.0, -1.0], abs=1e-5)  # (std + eps)
    assert adv.group_mean.tolist() == [0.5, 0.5, 0.5] and adv.groups == 1


def test_under_sequence_losses_a_two_chain_trajectory_weighs_as_one_sequence():
    # rows: trajectory A's chains (2 tokens of loss 1, then 1 token of loss 4), trajectory B (1 token of loss 0)
    per_token = torch.tensor([[1.0, 1.0], [4.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    whole = torch.tensor([3.0, 3.0, 1.0])  # each row's trajectory's tokens
    # A's token mean is (1 + 1 + 4) / 3 = 2, B's 0: their mean over 2 trajectories is 1
    assert float(aggregate(per_token, mask, "seq_mean_token_mean", total_sequences=2, sequence_tokens=whole)) == pytest.approx(1.0)
    # A's token sum 6, B's 0, over 2 trajectories: 3
    assert float(aggregate(per_token, mask, "seq_mean_token_sum", total_sequences=2, sequence_tokens=whole)) == pytest.approx(3.0)
    # token mean: every token once, chains or not: 6 / 4
    assert float(aggregate(per_token, mask, "token_mean")) == pytest.approx(1.5)
    # (rows counted as sequences, as before: (1 + 4 + 0) / 3)
    assert float(aggregate(per_token, mask, "seq_mean_token_mean")) == pytest.approx(5 / 3)


def test_a_trajectorys_trained_facts_add_up_over_its_chains():
    one = TrainedSample(1.0, 0.5, 0.5, False, True, action_tokens=3, rejected_tokens=1, correction_weight_mean=1.0,
                        learner_logprobs=(-0.1, -0.2, -0.3), logprob_abs_diff_mean=0.1, logprob_abs_diff_max=0.2)
    two = TrainedSample(1.0, 0.5, 0.5, False, True, action_tokens=1, rejected_tokens=0, correction_weight_mean=0.4,
                        learner_logprobs=(-0.4,), logprob_abs_diff_mean=0.5, logprob_abs_diff_max=0.5)
    both = one.then(two)
    assert (both.action_tokens, both.rejected_tokens, both.learner_logprobs) == (4, 1, (-0.1, -0.2, -0.3, -0.4))
    assert both.correction_weight_mean == pytest.approx((1.0 * 2 + 0.4 * 1) / 3)  # over kept tokens: 2 and 1
    assert both.logprob_abs_diff_mean == pytest.approx((0.1 * 3 + 0.5 * 1) / 4) and both.logprob_abs_diff_max == 0.5
    elsewhere = TrainedSample(1.0, 0.5, 0.5, False, True, action_tokens=2)  # another rank trained it: π_old not here
    assert one.then(elsewhere).learner_logprobs is None and one.then(elsewhere).action_tokens == 5
