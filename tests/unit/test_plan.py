"""`loopline plan`'s arithmetic on hand-computed cases, and its verdict's suggestions checked by re-planning."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loopline.plan import GiB, Hardware, ModelShape, Workload, estimate, size, workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QWEN_7B = json.loads((EXAMPLES / "shapes" / "qwen2.5-7b" / "config.json").read_text())
SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json, shape fields
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
}


@pytest.mark.parametrize("config", [QWEN_7B, SMOLLM2], ids=["qwen2.5-7b", "smollm2-135m"])
def test_parameter_count_equals_the_model_transformers_builds(config):
    """Built on the meta device: no memory, the real module tree (biases, tied head) counted."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k not in ("model_type", "_comment")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert ModelShape.from_config(config).params == sum(p.numel() for p in model.parameters())


def test_kv_cache_bytes_per_token_by_hand():
    assert ModelShape.from_config(SMOLLM2).kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4  # 45 KiB in fp32
    assert ModelShape.from_config(QWEN_7B).kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2  # 56 KiB in bf16


def test_zero_stages_shard_weights_gradients_and_optimizer_states():
    shape = dataclasses.replace(ModelShape.from_config(SMOLLM2))
    p = shape.params
    big = Hardware("h100", 80 * GiB, 4)

    def rows(**work) -> dict[str, int]:
        return {r.part: r.bytes for r in estimate(shape, Workload(**work), big).learner}

    plain = rows(dtype_bytes=4, zero_stage=0, data_parallel=4)
    assert (plain["weights"], plain["gradients"], plain["optimizer states"]) == (4 * p, 4 * p, 8 * p)
    mixed = rows(dtype_bytes=2, zero_stage=1, data_parallel=4)  # fp32 master + Adam m, v: 12 B, over 4 ranks
    assert (mixed["weights"], mixed["gradients"], mixed["optimizer states"]) == (2 * p, 2 * p, 12 * p // 4)
    three = rows(dtype_bytes=2, zero_stage=3, data_parallel=4)
    assert (three["weights"], three["gradients"]) == (2 * p // 4, 2 * p // 4)


@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "v_proj")], ids=["all-linear", "q-v"])
def test_lora_trains_and_keeps_optimizer_states_for_the_adapters_peft_makes_and_no_reference_copy(targets):
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model("llama", **{k: v for k, v in SMOLLM2.items() if k != "model_type"})
    with torch.device("meta"):
        model = peft.inject_adapter_in_model(peft.LoraConfig(r=16, target_modules=targets), AutoModelForCausalLM.from_config(hf))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = ModelShape.from_config(SMOLLM2)
    assert shape.lora_params(16, targets) == adapters  # all-linear: 30 x 16 x (576+576 + 2 x (576+192) + 576+576 + 3 x (576+1536)) = 4.9M
    rows = {r.part: r.bytes for r in estimate(shape, Workload(lora=(16, targets), reference_model=True), Hardware("l4", 24 * GiB, 1)).learner}
    assert (rows["weights"], rows["gradients"], rows["optimizer states"]) == (4 * (shape.params + adapters), 4 * adapters, 8 * adapters)
    assert "reference model" not in rows  # the base with the adapters off


def test_activation_checkpointing_keeps_a_hidden_vector_per_token_and_layer():
    shape = ModelShape.from_config(SMOLLM2)
    per_layer = (5 * 1536 + 4 * 576 + 4 * 9 * 64) * 4 * 1000
    head = 2 * 576 * 4 * 1000 + 300 * 576 * 4  # final norm; the LM head's input at 300 positions (no logits kept)
    assert shape.layer_activation_bytes(1000, 4) == per_layer
    assert shape.kept_for_backward(1000, 300, 4, checkpointing=False) == 30 * per_layer + head
    assert shape.kept_for_backward(1000, 300, 4, checkpointing=True) == 30 * 576 * 4 * 1000 + head
    # while one chunk of the head runs: its fp32 logits, their softmax and gradient, at most 512 positions
    assert shape.head_chunk_bytes(300) == 3 * 300 * 49152 * 4 and shape.head_chunk_bytes(5000) == 3 * 512 * 49152 * 4
    from loopline import plan
    from loopline.trainer import config

    assert plan.HEAD_CHUNK == config.HEAD_CHUNK


def test_what_the_verdict_suggests_fits_and_one_more_does_not():
    shape = ModelShape.from_config(SMOLLM2)
    small = Hardware("cpu", 6 * GiB)
    work = Workload(concurrency=4096, sequence_tokens=2048, micro_batch_tokens=4096, step_tokens=4096)
    plan = estimate(shape, work, small)
    assert not plan.fits and f"concurrency {plan.max_concurrency}" in plan.verdict
    assert estimate(shape, dataclasses.replace(work, concurrency=plan.max_concurrency), small).fits
    assert not estimate(shape, dataclasses.replace(work, concurrency=plan.max_concurrency + 1), small).fits

    work = Workload(concurrency=8, sequence_tokens=512, micro_batch_tokens=200_000, step_tokens=200_000, gradient_checkpointing=False)
    plan = estimate(shape, work, small)
    assert not plan.fits and f"micro_batch_tokens {plan.max_micro_batch_tokens}" in plan.verdict
    fitted = dataclasses.replace(work, micro_batch_tokens=plan.max_micro_batch_tokens)
    assert estimate(shape, fitted, small).fits
    assert not estimate(shape, dataclasses.replace(fitted, micro_batch_tokens=plan.max_micro_batch_tokens + 50), small).fits


def test_a_step_of_trajectories_the_learner_cannot_hold_is_refused_with_what_to_change():
    from loopline.envregistry.spec import Budgets
    from loopline.config import RunConfig

    shape, host = ModelShape.from_config(SMOLLM2), Hardware("cpu", 24 * GiB)
    rows = {r.part: r.bytes for r in estimate(shape, Workload(step_tokens=10_000), host).learner}
    assert rows["step batch"] == 10_000 * 80
    config = RunConfig(name="r", env="e.yaml", rollout={"groups_per_step": 8, "group_size": 1_000_000_000})
    huge = estimate(shape, workload(config, Budgets(), 512, host), host)
    assert not huge.fits and "a smaller rollout.group_size" in huge.verdict


def test_learner_ranks_on_one_cpu_host_each_need_their_own_memory():
    """`learner.launch` on CPU: every rank holds its replica in the same host memory; the plan counts them all."""
    from loopline.envregistry.spec import Budgets
    from loopline.config import RunConfig

    shape = ModelShape.from_config(SMOLLM2)
    host = Hardware("cpu", 64 * GiB)
    one = estimate(shape, Workload(zero_stage=1, data_parallel=2), host)
    two = estimate(shape, Workload(zero_stage=1, data_parallel=2, ranks_per_device=2), host)
    engine = sum(r.bytes for r in one.engine)
    assert two.learner_bytes == one.learner_bytes  # the table is per rank
    assert "x2 ranks here" in two.verdict and f"need {size(2 * one.learner_bytes + engine)}" in two.verdict

    config = RunConfig(name="r", env="e.yaml", learner={"launch": {"ranks_per_node": 3}})
    assert workload(config, Budgets(), 64, host).ranks_per_device == 3
    assert workload(config, Budgets(), 64, Hardware("h100", 80 * GiB, 8)).ranks_per_device == 1  # a GPU each


def test_the_plan_command_on_a_7b_shaped_config():
    from loopline.cli import app

    runner = CliRunner()
    eight = runner.invoke(app, ["plan", str(EXAMPLES / "plan_7b_coding.yaml"), "--gpu", "h100", "--gpus", "8"])
    assert eight.exit_code == 0, eight.output
    assert "7.62B parameters" in eight.output and "ZeRO-3: / 8 ranks" in eight.output and "fits:" in eight.output
    one = runner.invoke(app, ["plan", str(EXAMPLES / "plan_7b_coding.yaml"), "--gpu", "h100", "--gpus", "1"])
    assert one.exit_code == 1 and "does NOT fit" in one.output and "optimizer states" in one.output
    unknown = runner.invoke(app, ["plan", str(EXAMPLES / "plan_7b_coding.yaml"), "--gpu", "tpu"])
    assert unknown.exit_code != 0 and "unknown hardware 'tpu'" in unknown.output


def test_a_sync_runs_local_engine_is_counted_apart_from_the_learners_step():
    """A sync step's local engine drops its weights and KV caches before the learner steps and serves the learner's
    own weights: what the host holds is the larger of the learner's step and the rollouts beside the learner's
    weights and optimizer states (gradients and activations are gone by then). Async holds both at once."""
    from loopline.config import RunConfig
    from loopline.envregistry.spec import Budgets

    shape, host = ModelShape.from_config(SMOLLM2), Hardware("cpu", 64 * GiB)

    def plan(mode, concurrency):
        work = workload(RunConfig(name="r", env="e.yaml", rollout={"mode": mode, "concurrency": concurrency}), Budgets(), 512, host)
        return work, estimate(shape, work, host)

    for concurrency in (8, 512):  # the learner's step the larger, then the rollouts' KV caches
        work, apart = plan("sync", concurrency)
        learner, engine = ({r.part: r.bytes for r in rows} for rows in (apart.learner, apart.engine))
        rollouts = learner["weights"] + learner["optimizer states"] + engine["KV cache"]  # (no weights of its own)
        assert work.engine_yields and f"need {size(max(apart.learner_bytes, rollouts))}" in apart.verdict
        assert "serves the learner's weights" in apart.verdict
    assert rollouts > apart.learner_bytes  # (at 512 sequences)
    work, together = plan("async", 8)
    assert not work.engine_yields and f"need {size(together.learner_bytes + together.engine_bytes)}" in together.verdict
