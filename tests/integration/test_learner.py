"""The learner on DeepSpeed (CPU, fp32, gloo) and plain torch: updates, invariance, exact resume, bad input."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loopline.rollout.engines.base import SamplingParams
from loopline.rollout.engines.local import LocalEngine
from loopline.trainer.batch import TrainSequence
from loopline.trainer.checkpoint import weights_sha256
from loopline.trainer.learner import Learner, LearnerConfig, LearnerError
from loopline.trainer.losses import loss_settings
from tests.factories import kept_for_backward

PROMPTS = [[1, 87, 85, 261, 201], [1, 67, 85, 85, 277, 86], [1, 40, 41, 42], [1, 50, 51, 52, 53, 54, 55]]


def rollout_sequences(model_dir, temperature=1.0, samples=2, tokens=12) -> list[TrainSequence]:
    """Groups sampled by the real engine, with its logprobs as μ and made-up rewards."""
    async def go():
        engine = LocalEngine(model_dir)
        sampling = SamplingParams(temperature=temperature, max_new_tokens=tokens, seed=5)
        return await asyncio.gather(*(engine.generate(p, sampling, f"{i}/{k}/") for i, p in enumerate(PROMPTS) for k in range(samples)))

    out = []
    for n, gen in enumerate(asyncio.run(go())):
        prompt = PROMPTS[n // samples]
        ids = tuple(prompt) + gen.token_ids
        mask = (0,) * len(prompt) + (1,) * len(gen.token_ids)
        mu = (0.0,) * len(prompt) + gen.logprobs
        out.append(TrainSequence(None, n // samples, float(n % 2), ids, mask, mu))
    return out


@pytest.fixture(scope="module")
def batch(tiny_dirs):
    return rollout_sequences(tiny_dirs["v0"])


CONFIG = LearnerConfig(lr=1e-3, micro_batch_tokens=64, seed=0)


def test_rl_step_updates_the_policy_and_reports_why(tiny_dirs, batch):
    learner = Learner(tiny_dirs["v0"], CONFIG, backend="deepspeed")
    before = learner.parameters_vector()
    result = learner.rl_step(batch)
    assert result.skipped is None and not torch.equal(before, learner.parameters_vector())
    m = result.metrics
    # invariant 3: same weights, the learner's recompute matches the engine's logprobs
    assert m["logprob_abs_diff"] < 1e-4 and abs(m["logprob_kl"]) < 1e-6
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # one minibatch: π_θ == π_old at the first forward
    assert m["tokens_trained"] == sum(s.action_tokens for s in batch) and m["degenerate_groups"] == 0
    assert {"loss", "kl_ref", "clip_fraction", "advantage_mean", "advantage_std", "correction_capped_fraction"} <= set(m)
    assert m["reward_std"] == pytest.approx(2 ** -0.5) and m["lr"] == pytest.approx(1e-3)  # each group's rewards are 0 and 1: sample std 1/√2


def test_the_recorded_learning_rate_follows_the_warm_up(tiny_dirs, batch):
    """`lr` is the rate of the step's first optimizer step: with a 4-step linear warm-up and 2 minibatches,
    steps 1 and 2 start at optimizer steps 0 and 2: 1/4 and 3/4 of lr (on DeepSpeed, which steps the schedule)."""
    learner = Learner(tiny_dirs["v0"], CONFIG.model_copy(update={"warmup_steps": 4, "minibatches": 2}), backend="deepspeed")
    assert [learner.rl_step(batch).metrics["lr"] for _ in range(2)] == pytest.approx([0.25e-3, 0.75e-3])


def test_logprobs_at_action_positions_equal_the_full_vocabulary_log_softmax(tiny_dirs, batch):
    """Only the positions that predict an action token go through the LM head; their logprobs are the same."""
    from loopline.trainer.batch import micro_batches, pad

    learner = Learner(tiny_dirs["v0"], CONFIG, backend="torch")
    for rows in micro_batches(batch, 64):
        b = pad(batch, rows)
        with torch.no_grad():
            sliced = learner._logprobs(b)
            full = torch.log_softmax(learner.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float(), -1)
            full = full.gather(-1, b.input_ids[:, 1:, None])[..., 0]
        mask = b.target_mask.bool()
        assert torch.allclose(sliced[mask], full[mask], atol=1e-5) and (sliced[~b.target_mask.bool().any(0).expand_as(mask)] == 0).all()


def shared_prompt_batch() -> list[TrainSequence]:
    """Three groups of four rows sharing their prompt; multi-turn rows (an action, a tool output, another action)."""
    import random

    rng = random.Random(0)
    seqs = []
    for g in range(3):
        prompt = tuple(rng.randrange(300) for _ in range(10 + 3 * g))
        for k in range(4):
            n, obs = rng.randint(3, 9), rng.randint(0, 4)
            ids = prompt + tuple(rng.randrange(300) for _ in range(n + obs + 3))
            mask = (0,) * len(prompt) + (1,) * n + (0,) * obs + (1,) * 3
            seqs.append(TrainSequence(None, g, float(k % 2), ids, mask, tuple(-rng.random() if m else 0.0 for m in mask)))
    return seqs


@pytest.mark.parametrize("passes", ["one suffix pass", "a suffix pass per length"])
def test_a_shared_prompt_runs_once_and_changes_nothing_but_the_cost(tiny_dirs, passes, monkeypatch):
    """Rows of a group share their prompt: it runs once, its KV cache serves every row (multi-turn rows
    too), their suffixes in one pass or in several (trainer/prefix.py's `suffix_chunks`, each padded to its
    longest row). Logprobs and the update equal the unshared ones."""
    from loopline.trainer import prefix
    from loopline.trainer.batch import pad
    from loopline.trainer.prefix import plan

    monkeypatch.setattr(prefix, "SUFFIX_PASS_OVERHEAD", 10**6 if passes == "one suffix pass" else 0)

    seqs = shared_prompt_batch()
    shared = Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-3, share_prefix=True), backend="torch")
    plain = Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-3, share_prefix=False), backend="torch")
    b = pad(seqs, list(range(len(seqs))))
    assert plan(b).saved_tokens == 3 * (9 + 12 + 15)  # each prompt (minus its last token) runs once, not 4 times
    entropies: list[torch.Tensor] = []
    with torch.no_grad():
        one, other = shared._logprobs(b, entropy=entropies), plain._logprobs(b, entropy=entropies)
    m = b.target_mask.bool()
    assert torch.allclose(one[m], other[m], atol=1e-5) and (one[~m] == 0).all()
    # the policy's entropy at the same places, by both paths (0 elsewhere); a step records its mean there
    assert torch.allclose(entropies[0][m], entropies[1][m], atol=1e-4) and (entropies[0][m] > 0).all() and (entropies[0][~m] == 0).all()
    recorded = shared.rl_step(seqs).metrics["entropy"]
    plain.rl_step(seqs)
    assert recorded == pytest.approx(float(entropies[1][m].mean()), rel=1e-4)
    assert torch.allclose(shared.parameters_vector(), plain.parameters_vector(), atol=1e-5)


@pytest.mark.parametrize("share", [True, False], ids=["shared-prefix", "plain"])
def test_the_head_run_a_chunk_at_a_time_keeps_no_logits_and_makes_the_same_update(tiny_dirs, share, monkeypatch):
    """The LM head runs on a few positions at a time (trainer/head.py), its logits made again in backward, not
    kept: π_old, the loss, the entropy, the KL to the reference and the update equal the whole-logits path's."""
    from loopline.trainer import head
    from loopline.trainer.batch import pad

    monkeypatch.setattr(head, "HEAD_CHUNK", 5)  # (several chunks a micro-batch)
    seqs = shared_prompt_batch()
    config = LearnerConfig(lr=1e-3, share_prefix=share, temperature=0.7, loss=loss_settings(kl_coef=0.1))
    chunked, whole = (Learner(tiny_dirs["v0"], config, backend="torch") for _ in range(2))
    whole._plain_head = False  # (the path a model with a soft-capped or scaled head takes)
    b = pad(seqs, list(range(len(seqs))))
    assert kept_for_backward(chunked, b) < 0.7 * kept_for_backward(whole, b)
    assert chunked._plain_head is True
    a, c = chunked.rl_step(seqs), whole.rl_step(seqs)
    for name in ("loss", "entropy", "kl_ref", "logprob_abs_diff"):
        assert a.metrics[name] == pytest.approx(c.metrics[name], rel=1e-5, abs=1e-7), name
    assert torch.allclose(chunked.parameters_vector(), whole.parameters_vector(), atol=1e-5)  # (lr 1e-3: Adam moves every weight ~1e-3)


def test_a_head_whose_output_the_model_transforms_keeps_the_whole_logits_path():
    """Gemma 2 soft-caps its logits after the head: its hidden states through the head are not its logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    from loopline.trainer.head import plain_head

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    assert plain_head(LlamaForCausalLM(LlamaConfig(**small)))
    assert not plain_head(Gemma2ForCausalLM(Gemma2Config(**small, final_logit_softcapping=1.0)))


@pytest.mark.parametrize("share", [True, False], ids=["shared-prefix", "plain"])
def test_gradient_checkpointing_keeps_less_for_backward_and_makes_the_same_update(tiny_dirs, share):
    """Each layer replays in backward: the prefix caches must give the same keys on the replay (a plain
    DynamicCache would append them twice), so the update equals the one without checkpointing."""
    from loopline.trainer.batch import pad

    seqs = shared_prompt_batch()
    on, off = (
        Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-3, share_prefix=share, gradient_checkpointing=gc), backend="torch")
        for gc in (True, False)
    )
    b = pad(seqs, list(range(len(seqs))))
    assert kept_for_backward(on, b) < 0.5 * kept_for_backward(off, b)
    a, c = on.rl_step(seqs), off.rl_step(seqs)
    assert a.metrics["loss"] == pytest.approx(c.metrics["loss"], abs=1e-7)
    assert torch.allclose(on.parameters_vector(), off.parameters_vector(), atol=1e-6)


def test_reusing_the_loss_forward_as_pi_old_makes_the_same_update(tiny_dirs, batch):
    """One optimizer step: π_old is taken from the loss's own forward (no extra pass). MIS with bounds that
    reject nothing and TIS with a cap no ratio reaches compute the same loss; MIS keeps the separate pass."""

    wide = dict(correction_cap=1e9)
    reused = Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-3, micro_batch_tokens=64, loss=loss_settings(correction="tis", **wide)), backend="torch")
    separate = Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-3, micro_batch_tokens=64, loss=loss_settings(correction="mis", **wide)), backend="torch")
    a, b = reused.rl_step(batch), separate.rl_step(batch)
    assert torch.allclose(reused.parameters_vector(), separate.parameters_vector(), atol=1e-7)
    assert a.metrics["logprob_abs_diff"] == pytest.approx(b.metrics["logprob_abs_diff"], abs=1e-6)
    assert a.metrics["logprob_abs_diff"] < 1e-4


@pytest.mark.parametrize("stage", [0, 1])
def test_deepspeed_refuses_a_non_finite_gradient_norm(stage):
    """A finite loss with a NaN gradient (0 * inf in an unselected branch): refused (stage 0 before the step,
    ZeRO after it); the learner then refuses further steps instead of training on NaN weights."""
    from loopline.trainer.backends import DeepSpeedBackend, NonFiniteGradient

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    backend = DeepSpeedBackend(model, optimizer, scheduler, grad_clip=1.0, zero_stage=stage, dtype="fp32")

    def loss_of(_batch):
        w = backend.model.weight.sum()
        return torch.where(torch.tensor(True), w * 0.0, w * float("inf")), {}

    with pytest.raises(NonFiniteGradient):
        backend.optimise([None], loss_of, LearnerError)
    with pytest.raises(LearnerError, match="refused halfway"):
        backend.optimise([None], loss_of, LearnerError)


@pytest.mark.parametrize("stage", [None, 1], ids=["default", "zero1"])
def test_deepspeed_and_plain_torch_make_the_same_update(tiny_dirs, batch, stage):
    """By default one rank runs without ZeRO (its flat fp32 copies would partition nothing); ZeRO-1 too."""

    ds = Learner(tiny_dirs["v0"], CONFIG.model_copy(update={"zero_stage": stage}), backend="deepspeed")
    assert ds.backend.zero_stage == (0 if stage is None else stage)
    plain = Learner(tiny_dirs["v0"], CONFIG, backend="torch")
    a, b = ds.rl_step(batch), plain.rl_step(batch)
    assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], abs=1e-6)
    assert torch.allclose(ds.parameters_vector(), plain.parameters_vector(), atol=1e-6)


@pytest.mark.parametrize("stage", [None, 1], ids=["default", "zero1"])
def test_deepspeed_steps_once_per_step_when_the_micro_batch_count_changes(tiny_dirs, batch, stage):
    """DeepSpeed counts micro-steps over the whole run and steps where the count is a multiple of the accumulation:
    steps of 3 then 2 micro-batches would update after the 4th (mid-step, its rest carried into the next step)
    unless the boundary is set each time. The quickstart's logprob gap (invariant 3) showed it: 0.0105 at step 2."""
    from loopline.trainer.batch import micro_batches

    ds = Learner(tiny_dirs["v0"], CONFIG.model_copy(update={"zero_stage": stage}), backend="deepspeed")
    plain = Learner(tiny_dirs["v0"], CONFIG, backend="torch")
    steps = [batch, batch[:4], batch[2:], batch]
    assert len({len(micro_batches(b, CONFIG.micro_batch_tokens)) for b in steps}) > 1  # (the counts differ)
    for step in steps:
        a, b = ds.rl_step(step), plain.rl_step(step)
        assert a.metrics["logprob_abs_diff"] == pytest.approx(b.metrics["logprob_abs_diff"], abs=1e-6)
        assert torch.allclose(ds.parameters_vector(), plain.parameters_vector(), atol=1e-5)


def test_micro_batching_changes_nothing_but_memory(tiny_dirs, batch):
    small = Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-3, micro_batch_tokens=20), backend="torch")
    large = Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-3, micro_batch_tokens=10_000), backend="torch")
    a, b = small.rl_step(batch), large.rl_step(batch)
    assert a.metrics["loss"] == pytest.approx(b.metrics["loss"], abs=1e-6)
    # compare the accumulated gradients (Adam's normalisation would magnify float rounding in tiny ones)
    grads = [torch.cat([p.grad.reshape(-1) for p in l.model.parameters()]) for l in (small, large)]
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def test_resume_from_a_checkpoint_is_exact(tiny_dirs, batch, tmp_path):
    straight = Learner(tiny_dirs["v0"], CONFIG, backend="deepspeed")
    straight.rl_step(batch)
    straight.rl_step(batch)

    first = Learner(tiny_dirs["v0"], CONFIG, backend="deepspeed")
    first.rl_step(batch)
    first.save_checkpoint(tmp_path / "ckpt-1", policy_version=1, cursor={"learner_step": 1})
    resumed = Learner(tiny_dirs["v0"], CONFIG, backend="deepspeed")
    state = resumed.load_checkpoint(tmp_path / "ckpt-1")
    assert state["policy_version"] == 1 and state["cursor"] == {"learner_step": 1}
    resumed.rl_step(batch)
    assert torch.equal(straight.parameters_vector(), resumed.parameters_vector())


def test_minibatches_use_pi_old_as_anchor(tiny_dirs, batch):
    learner = Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-2, micro_batch_tokens=30, minibatches=2), backend="torch")
    m = learner.rl_step(batch).metrics
    assert abs(m["ratio_mean"] - 1.0) > 1e-3  # the second minibatch sees a policy that moved away from π_old


def test_gspo_moves_the_policy_as_vanilla_on_its_first_optimizer_step_and_apart_after(tiny_dirs, batch):
    """On the first optimizer step π_θ = π_old: every ratio, a token's or its sequence's, is 1 with the token's own
    gradient, so GSPO's update is vanilla PPO's to the bit. From the second minibatch on, π_θ has moved: GSPO's
    ratios are its sequences' geometric means, vanilla's each token's own, and the updates differ."""
    def trained(mode: str, minibatches: int) -> tuple[torch.Tensor, dict]:
        config = LearnerConfig(lr=1e-2, micro_batch_tokens=30, minibatches=minibatches, loss=loss_settings(policy_loss=mode, clip_low=3e-4, clip_high=4e-4))
        learner = Learner(tiny_dirs["v0"], config, backend="torch")
        metrics = learner.rl_step(batch).metrics
        return learner.parameters_vector(), metrics

    one = {mode: trained(mode, 1) for mode in ("vanilla", "gspo")}
    assert torch.equal(one["vanilla"][0], one["gspo"][0]) and one["gspo"][1]["clip_fraction"] == 0.0
    two = {mode: trained(mode, 2) for mode in ("vanilla", "gspo")}
    assert not torch.equal(two["vanilla"][0], two["gspo"][0])
    assert abs(two["gspo"][1]["ratio_mean"] - two["vanilla"][1]["ratio_mean"]) > 1e-4


def test_export_is_loadable_by_the_engine_with_a_checksum(tiny_dirs, batch, tmp_path):
    learner = Learner(tiny_dirs["v0"], CONFIG, backend="deepspeed")
    learner.rl_step(batch)
    learner.export_weights(tmp_path / "v1")
    digest = learner.weights_sha256()
    assert digest == weights_sha256(tmp_path / "v1") and len(digest) == 64  # the same identity in memory and on disk
    assert (tmp_path / "v1" / "tokenizer.json").exists()

    async def serve():
        engine = LocalEngine(tiny_dirs["v0"])
        await engine.update_weights(1, tmp_path / "v1")
        return engine.version(), await engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=4), "r/")

    version, gen = asyncio.run(serve())
    assert version == 1 and gen.policy_version == 1


def test_bad_batches_and_checkpoints_are_refused(tiny_dirs, batch, tmp_path):
    learner = Learner(tiny_dirs["v0"], CONFIG, backend="torch")
    with pytest.raises(LearnerError, match="empty batch"):
        learner.rl_step([])
    no_actions = [TrainSequence(None, 0, r, (1, 2, 3), (0, 0, 0), (0.0,) * 3) for r in (0.0, 1.0)]
    assert learner.rl_step(no_actions).skipped is not None
    poisoned = [batch[0], TrainSequence(None, 0, 0.0, batch[1].input_ids, batch[1].action_mask, (float("nan"),) * len(batch[1].input_ids))]
    before = learner.parameters_vector()
    with pytest.raises(LearnerError, match="NaN"):
        learner.rl_step(poisoned)
    assert torch.equal(before, learner.parameters_vector())
    (tmp_path / "half").mkdir()
    with pytest.raises(LearnerError, match="not a complete loopline checkpoint"):
        learner.load_checkpoint(tmp_path / "half")
    other = Learner(tiny_dirs["other"], CONFIG, backend="torch")
    other.save_checkpoint(tmp_path / "other", policy_version=0)
    with pytest.raises(LearnerError, match="another model"):
        learner.load_checkpoint(tmp_path / "other")
    if not torch.cuda.is_available():
        with pytest.raises(LearnerError, match="bf16"):
            Learner(tiny_dirs["v0"], LearnerConfig(dtype="bf16"), backend="torch")
        with pytest.raises(LearnerError, match="fp16 was asked for, but this machine has no CUDA GPU"):
            Learner(tiny_dirs["v0"], LearnerConfig(dtype="fp16"))


DS_WORKER = """
import json, sys, torch
from loopline.trainer.batch import TrainSequence
from loopline.trainer.learner import Learner, LearnerConfig, LearnerError
from loopline.trainer.losses import loss_settings
model_dir, data, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds --local_rank
batch = [TrainSequence(None, g, r, tuple(i), tuple(m), tuple(mu)) for g, r, i, m, mu in json.load(open(data))]
learner = Learner(model_dir, LearnerConfig(lr=1e-3, micro_batch_tokens=64, zero_stage=2), backend="deepspeed")
learner.rl_step(batch)
if torch.distributed.get_rank() == 0:
    json.dump(learner.parameters_vector().tolist(), open(out, "w"))
"""


def test_logprob_gap_is_measured_on_the_trained_versions_own_tokens(tiny_dirs, batch):
    """Async: samples of an older version (here: μ shifted by 0.5) are staleness, reported apart from invariant 3."""
    import dataclasses

    fresh = [dataclasses.replace(s, policy_version=4) for s in batch[::2]]
    stale = [
        dataclasses.replace(s, policy_version=3, policy_version_max=4, behaviour_logprobs=tuple(x - 0.5 * m for x, m in zip(s.behaviour_logprobs, s.action_mask)))
        for s in batch[1::2]
    ]
    learner = Learner(tiny_dirs["v0"], CONFIG, backend="torch")
    m = learner.rl_step(fresh + stale, trained_version=4).metrics
    assert m["logprob_abs_diff"] < 1e-4
    assert m["logprob_gap_tokens"] == sum(s.action_tokens for s in fresh)
    assert m["logprob_abs_diff_stale"] == pytest.approx(0.5, abs=1e-4)


@pytest.mark.slow
def test_two_process_zero2_through_the_deepspeed_launcher(tiny_dirs, batch, tmp_path):
    """Two ranks share the batch's micro-batches; their averaged update must equal one process's on the whole batch."""
    script = tmp_path / "worker.py"
    script.write_text(DS_WORKER)
    data = tmp_path / "batch.json"
    data.write_text(json.dumps([[s.group_id, s.reward, s.input_ids.tolist(), s.action_mask.tolist(), s.behaviour_logprobs.tolist()] for s in batch]))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launched = subprocess.run(
        [str(Path(sys.executable).with_name("deepspeed")), "--num_nodes", "1", "--num_gpus", "2", "--master_port", "29561", str(script), str(tiny_dirs["v0"]), str(data), str(tmp_path / "two.json")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    single = Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-3, micro_batch_tokens=64, zero_stage=2), backend="deepspeed")
    single.rl_step(batch)
    two = torch.tensor(json.loads((tmp_path / "two.json").read_text()))
    assert torch.equal(two, single.parameters_vector())  # measured: bit-identical on CPU


def test_deepspeed_learner_without_a_launcher_even_with_a_stray_rank(tiny_dirs, tmp_path):
    """A child of a process that ran a learner inherits RANK etc. but no MASTER_*: still a one-process world."""
    script = f"from loopline.trainer.learner import Learner; Learner({str(tiny_dirs['v0'])!r}, backend='deepspeed'); print('ok')"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_a_stale_extension_build_lock_cannot_hang_the_learner(tiny_dirs, tmp_path):
    """A build of DeepSpeed's CPU comm op killed midway leaves its lock file; later learners must not wait on it."""
    extensions = tmp_path / "torch_extensions"
    for folder in ("deepspeed_shm_comm", "py311_cpu/deepspeed_shm_comm"):
        (extensions / folder).mkdir(parents=True)
        (extensions / folder / "lock").write_text("")
    script = (
        f"from loopline.trainer.learner import Learner; Learner({str(tiny_dirs['v0'])!r}, backend='deepspeed'); "
        "import deepspeed.comm.comm as c; print('ok', c.cdb.shm_comm_op)"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok None"), done.stdout[-1000:] + done.stderr[-2000:]
    assert not list(extensions.rglob("*.so"))  # nothing was compiled


def _groups_sharing_prompts(groups=8, size=4, seed=0) -> list[TrainSequence]:
    """GRPO's shape: every group's samples share their prompt (so the learner runs each prompt once)."""
    import random
    import uuid

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(20, 60))]
        for k in range(size):
            gen = [rng.randrange(3, 200) for _ in range(rng.randrange(5, 30))]
            mu = [-3 * rng.random() for _ in gen]
            out.append(TrainSequence(
                uuid.UUID(int=g * size + k), g, float(rng.random() > 0.5), tuple(prompt + gen),
                (0,) * len(prompt) + (1,) * len(gen), (0.0,) * len(prompt) + tuple(mu),
            ))
    return out


def test_a_step_gives_the_same_weights_every_time_while_other_processes_load_the_cpus():
    """Issue 29: a resume rebuilds unexported versions by replaying steps and compares digests, so a CPU step
    must be bit-exact under load with the default thread count. The shared-prompt gradient was summed with
    atomic float adds in a thread-dependent order: 2-3 different digests in 3 runs under load (3 here)."""
    from loopline.policies.sources import SHIPPED_STARTERS
    from tests.helpers import cpu_load

    starter = sorted(SHIPPED_STARTERS.glob("tiny-*"))[0]  # trained: real, non-trivial gradients

    batch = _groups_sharing_prompts()
    digests = set()
    with cpu_load(2):
        for _ in range(4):
            learner = Learner(starter, LearnerConfig(lr=1e-3), backend="deepspeed")
            for _ in range(2):
                learner.rl_step(batch)
            digests.add(learner.weights_sha256())
    assert len(digests) == 1, digests


def test_kl_to_the_reference_is_zero_at_first_then_the_hand_computed_k3_of_the_moved_policy(tiny_dirs):
    """Issue 32: `loss: {kl_coef: β}` reads the run's initial weights as the reference (frozen, shared-prefix
    aware like the policy). Its metric equals k3 over the action tokens computed here from two full forwards."""
    from transformers import AutoModelForCausalLM

    from loopline.trainer.batch import pad
    from loopline.trainer.losses import loss_settings

    seqs = shared_prompt_batch()
    learner = Learner(tiny_dirs["v0"], LearnerConfig(lr=1e-2, loss=loss_settings(kl_coef=0.05)), backend="torch")
    assert learner.rl_step(seqs).metrics["kl_ref"] == 0.0  # π_θ = π_ref until the first update

    b = pad(seqs, list(range(len(seqs))))
    reference = AutoModelForCausalLM.from_pretrained(tiny_dirs["v0"], dtype=torch.float32)

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, b.input_ids[:, 1:, None])[..., 0]

    m = b.target_mask.bool()
    log_ratio = (logprobs(reference) - logprobs(learner.model))[m].double()
    expected = float((log_ratio.exp() - log_ratio - 1).mean())
    assert expected > 1e-5  # the first update moved the policy
    assert learner.rl_step(seqs).metrics["kl_ref"] == pytest.approx(expected, rel=1e-3)
    assert not any(p.requires_grad for p in learner.reference.model.parameters())


def test_a_trajectory_of_two_chains_is_trained_as_two_sequences_with_one_advantage(tiny_dirs, batch):
    """Issue 48: an agent that rewrote its history has two chains; both are trained, with the advantage its one
    reward earns in its group (counting the chain as a sample would shift the group's mean to 2/3)."""
    import dataclasses
    import uuid

    a, b = uuid.uuid4(), uuid.uuid4()
    first, second = dataclasses.replace(batch[0], trajectory_id=a), dataclasses.replace(batch[1], trajectory_id=b)  # rewards 0, 1
    extra = dataclasses.replace(batch[2], trajectory_id=b, group_id=second.group_id, reward=second.reward, chain=1)
    result = Learner(tiny_dirs["v0"], CONFIG, backend="torch").rl_step([first, second, extra])
    m = result.metrics
    assert result.skipped is None and m["groups"] == 1 and m["sequences_trained"] == 3 and m["reward_mean"] == 0.5
    assert m["tokens_trained"] == sum(s.action_tokens for s in (first, second, extra))
    one, two = result.samples[a], result.samples[b]
    assert two.advantage == pytest.approx(-one.advantage) and two.advantage > 0 and two.group_mean == 0.5
    assert two.action_tokens == second.action_tokens + extra.action_tokens and len(two.learner_logprobs) == two.action_tokens
    assert m["logprob_abs_diff"] < 1e-4  # each chain's recompute matches what the engine sampled
