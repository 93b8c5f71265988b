"""LoRA: only the adapters train and are checkpointed; what leaves the learner (sha256, exports, the in-process
engine's weights) is the merged model under the base model's names; the KL reference is the base."""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM

from loopline.trainer.checkpoint import weights_sha256
from loopline.trainer.config import LoraConfig, loss_settings
from loopline.trainer.learner import Learner, LearnerConfig, LearnerError
from tests.integration.test_learner import PROMPTS, rollout_sequences
from tests.integration.test_train_flow import STARTER

LORA = LearnerConfig(lr=1e-2, micro_batch_tokens=64, seed=0, lora=LoraConfig(rank=4, alpha=8))


@pytest.fixture(scope="module")
def batch():
    return rollout_sequences(STARTER)  # the trained starter: its rewards below move the policy


def _base():
    return AutoModelForCausalLM.from_pretrained(STARTER, dtype=torch.float32)


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_lora_trains_the_adapters_alone_and_the_learner_shows_the_merged_model(backend, batch, tmp_path):
    learner = Learner(STARTER, LORA, backend=backend)
    adapters = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    # 2 layers x 7 linear layers (all-linear leaves the output head alone) x (A, B)
    assert len(adapters) == 28
    assert learner.weights_sha256() == weights_sha256(STARTER)  # B starts at 0: v0 is the base exactly
    assert learner.rl_step(batch).skipped is None

    base, merged = _base(), learner.state_dict()
    assert list(merged) == list(base.state_dict())  # the engine loads it with strict=True
    changed = {k for k, v in base.state_dict().items() if not torch.equal(v, merged[k])}
    # the adapted layers moved, nothing else did (embeddings, norms, the tied head)
    assert changed and all(k.endswith(("proj.weight")) for k in changed)
    for name, p in learner.model.named_parameters():
        if ".base_layer." in name:
            assert torch.equal(p, base.state_dict()[name.replace(".base_layer.", ".")]), f"{name}: the frozen base changed"
    # merged = W + (alpha / r) B A, by hand for one layer
    q = learner.model.model.layers[0].self_attn.q_proj
    by_hand = q.base_layer.weight + (8 / 4) * q.lora_B["default"].weight @ q.lora_A["default"].weight
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], by_hand, atol=1e-7)

    # the export is a plain model directory: its sha256 is the learner's, and it computes what the learner does
    learner.export_weights(tmp_path / "v1")
    assert weights_sha256(tmp_path / "v1") == learner.weights_sha256() != weights_sha256(STARTER)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "v1", dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, learner.model.eval()(input_ids=ids).logits, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bit_for_bit(backend, batch, tmp_path):
    straight = Learner(STARTER, LORA, backend=backend)
    straight.rl_step(batch)
    straight.rl_step(batch)

    first = Learner(STARTER, LORA, backend=backend)
    first.rl_step(batch)
    first.save_checkpoint(tmp_path / "lora", policy_version=1)
    full = Learner(STARTER, LORA.model_copy(update={"lora": None}), backend=backend)
    full.save_checkpoint(tmp_path / "full", policy_version=0)
    size = {k: sum(f.stat().st_size for f in (tmp_path / k).rglob("*") if f.is_file()) for k in ("lora", "full")}
    assert size["lora"] < size["full"] / 3, size  # the adapters and their Adam moments, not the base (1.4 MB)

    resumed = Learner(STARTER, LORA, backend=backend)
    resumed.load_checkpoint(tmp_path / "lora")
    resumed.rl_step(batch)
    assert torch.equal(straight.parameters_vector(), resumed.parameters_vector())
    assert straight.weights_sha256() == resumed.weights_sha256()
    with pytest.raises(LearnerError, match="lora"):  # a full learner cannot take an adapters-only checkpoint
        full.load_checkpoint(tmp_path / "lora")


def test_with_lora_the_kl_reference_is_the_base_with_the_adapters_off(batch):
    config = LORA.model_copy(update={"loss": loss_settings(kl_coef=0.05)})
    learner = Learner(STARTER, config, backend="torch")
    assert learner.rl_step(batch).metrics["kl_ref"] == 0.0  # B = 0: the policy is its reference
    second = learner.rl_step(batch).metrics["kl_ref"]
    assert second > 0
    # the same k3 against a separately loaded copy of the base (the full-model reference path)
    copy = Learner(STARTER, config.model_copy(update={"lora": None}), backend="torch")
    from loopline.trainer.batch import micro_batches, pad

    for rows in micro_batches(batch, 10_000):
        padded = pad(batch, rows)
        with torch.no_grad():
            assert torch.allclose(learner._logprobs(padded, learner.reference), copy._logprobs(padded, copy.reference), atol=1e-6)
    assert all(p.requires_grad == (".lora_" in n) for n, p in learner.model.named_parameters())  # the switch left them as they were


def test_lora_target_modules_the_model_lacks_are_one_line():
    with pytest.raises(LearnerError, match="learner.lora"):
        Learner(STARTER, LORA.model_copy(update={"lora": LoraConfig(rank=4, target_modules=("no_such_proj",))}), backend="torch")
