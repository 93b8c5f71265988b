"""Memory before launch: what a run config needs on given hardware, and whether it fits (engine and learner on the same devices, or apart).

Out-of-memory after minutes of setup is among the most reported failures of RL trainers; the arithmetic
that predicts it is short. Weights, gradients and optimizer states follow from the parameter count (by
ZeRO stage and data-parallel size); activations from the model's shape and the micro-batch's tokens;
the engine's KV cache from 2 x layers x KV heads x head dim bytes per token. The activation terms are
calibrated against what autograd keeps on this code (`tests/integration/test_plan.py`, the tiny
policy and SmolLM2-135M):

  per token and layer, without checkpointing: 5 x intermediate (MLP: gate, up, activation, product,
  activation input) + 4 x hidden (two RMSNorms: input and output) + 4 x heads x head dim (query,
  attention output, and the keys and values SDPA's math path expands to every head);
  with checkpointing (`learner.gradient_checkpointing`): one hidden vector per token and layer, plus
  one layer's activations while it is replayed;
  the final norm's input and output, and where an action token is predicted the LM head's input; the
  head runs on `HEAD_CHUNK` of those positions at a time and keeps no logits (trainer/head.py): while a chunk
  runs, its fp32 logits, their softmax and their gradient exist.

Learner and engine on one device are counted together, except in a sync run on the built-in local engine: it
drops its weights and KV caches before each learner step (`stages.release_engine_memory`) and serves the
learner's own weights (`LentWeights`), so the larger of the learner's step and the rollouts (beside the learner's
weights and optimizer states, which stay) counts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from loopline.errors import LooplineError

HEAD_CHUNK = 512  # the learner's (loopline/trainer/config.py; the plan imports no layer: a test holds them equal)
GiB = 1024**3
HEADROOM = 0.9  # of a device's memory: the CUDA context, the allocator's fragmentation, the runtime


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs from a Hugging Face config.json."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_context: int
    attention_bias: bool = False

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> "ModelShape":
        text = config.get("text_config", config)
        try:
            hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
            return cls(
                layers=int(text["num_hidden_layers"]), hidden=hidden, heads=heads,
                kv_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or hidden // heads),
                intermediate=int(text["intermediate_size"]), vocab=int(text["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                max_context=int(text.get("max_position_embeddings", 2048)),
                attention_bias=bool(text.get("attention_bias", False)),
            )
        except KeyError as missing:
            raise LooplineError(f"{source}: no {missing.args[0]!r}; `loopline plan` reads decoder-only transformer configs") from None

    @classmethod
    def from_dir(cls, directory: str | Path) -> "ModelShape":
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise LooplineError(f"{directory}: no config.json (a model directory, or just its config.json, is needed)")
        return cls.from_config(json.loads(path.read_text()), str(path))

    @property
    def params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * q + 2 * self.hidden * kv + q * self.hidden + ((q + 2 * kv) if self.attention_bias else 0)
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * layer + self.hidden + head

    def linear_layers(self) -> dict[str, tuple[int, int]]:
        """A decoder layer's linear layers by their usual (Llama-style) names: (in, out) features."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def lora_params(self, rank: int, targets: str | tuple[str, ...]) -> int:
        """Adapter parameters: rank x (in + out) per adapted linear layer (all-linear: every one but the head)."""
        layers = self.linear_layers()
        chosen = layers if targets == "all-linear" else {k: v for k, v in layers.items() if k in set((targets,) if isinstance(targets, str) else targets)}
        return self.layers * sum(rank * (fan_in + fan_out) for fan_in, fan_out in chosen.values())

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def layer_activation_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """What one decoder layer keeps for its backward (all of it while a checkpointed layer is replayed)."""
        return (5 * self.intermediate + 4 * self.hidden + 4 * self.heads * self.head_dim) * dtype_bytes * tokens

    def kept_for_backward(self, tokens: int, positions: int, dtype_bytes: int, checkpointing: bool) -> int:
        """What autograd holds between a micro-batch's forward and its backward: the layers' activations (with
        checkpointing only their inputs), the final norm's input and output, and at the `positions` that
        predict an action token the LM head's input (its logits are made again in backward, not kept)."""
        layers = self.layers * (self.hidden * dtype_bytes * tokens if checkpointing else self.layer_activation_bytes(tokens, dtype_bytes))
        return layers + 2 * self.hidden * dtype_bytes * tokens + positions * self.hidden * dtype_bytes

    def head_chunk_bytes(self, positions: int) -> int:
        """What one chunk of the LM head holds while it runs: fp32 logits, their softmax and gradient."""
        return 3 * min(positions, HEAD_CHUNK) * self.vocab * 4


@dataclass(frozen=True)
class Hardware:
    name: str
    memory: int  # bytes per device (host memory for cpu)
    devices: int = 1

    @property
    def gpu(self) -> bool:
        return self.name != "cpu"


GPU_MEMORY = {  # what the driver reports (nvidia-smi), MiB
    "h200": 143_771,
    "h100": 81_559,
    "a100-80g": 81_920,
    "l4": 23_034,
}


def hardware(name: str, devices: int = 1) -> Hardware:
    if name == "cpu":
        return Hardware("cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 1)
    if name not in GPU_MEMORY:
        raise LooplineError(f"unknown hardware {name!r}: one of cpu, {', '.join(GPU_MEMORY)}")
    return Hardware(name, GPU_MEMORY[name] * 1024**2, devices)


def nvidia_device_present() -> bool:
    """Whether an NVIDIA device node exists: without one there is no CUDA GPU, known without importing torch
    (~2 s), so what a CPU host refuses is refused at once."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def this_machine() -> Hardware:
    """Where `loopline train` will run: the first GPU if torch sees one, else this host's memory."""
    if not nvidia_device_present():
        return hardware("cpu")
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return Hardware(props.name, props.total_memory, torch.cuda.device_count())
    return hardware("cpu")


@dataclass(frozen=True)
class Workload:
    """The run config's numbers the memory depends on."""

    dtype_bytes: int = 4  # learner: 4 fp32, 2 bf16 or fp16 (then with fp32 master weights and optimizer states)
    zero_stage: int = 0
    data_parallel: int = 1
    gradient_checkpointing: bool = True
    micro_batch_tokens: int = 16384  # tokens a micro-batch may hold
    step_tokens: int = 16384  # tokens of one learner step (all sequences, padded)
    action_fraction: float = 0.5  # of a sequence's tokens, those the policy generated
    reference_model: bool = False  # KL to a reference: a frozen copy of the weights
    lora: tuple[int, str | tuple[str, ...]] | None = None  # (rank, target modules): only adapters are trained
    concurrency: int = 32  # sequences the engine holds at once
    sequence_tokens: int = 1024  # a sequence's longest context: prompt + turns x (new tokens + tool output)
    engine_dtype_bytes: int = 4
    colocated: bool = True  # learner and engine share the device (CPU: one process; one GPU)
    engine_yields: bool = False  # a sync step's engine (the built-in local one) gives its weights and KV caches back while the learner runs
    ranks_per_device: int = 1  # learner ranks whose memory one device holds (CPU: every rank on the host)


@dataclass(frozen=True)
class Row:
    part: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class Plan:
    hardware: Hardware
    learner: list[Row]
    engine: list[Row]
    fits: bool
    verdict: str
    max_concurrency: int
    max_micro_batch_tokens: int
    budget: int  # bytes usable on one device (HEADROOM of its memory)

    @property
    def learner_bytes(self) -> int:
        return sum(r.bytes for r in self.learner)

    @property
    def engine_bytes(self) -> int:
        return sum(r.bytes for r in self.engine)

    def as_dict(self) -> dict:
        """What the ledger keeps with the run (`run.plan`), for the inspector."""
        return {
            "hardware": self.hardware.name, "memory": self.hardware.memory, "budget": self.budget, "fits": self.fits,
            "verdict": self.verdict, "learner": {r.part: r.bytes for r in self.learner}, "engine": {r.part: r.bytes for r in self.engine},
        }

    def table(self) -> str:
        lines = []
        for title, rows, total in (("learner, per rank", self.learner, self.learner_bytes), ("engine, per server", self.engine, self.engine_bytes)):
            lines.append(title)
            lines += [f"  {r.part:18s} {size(r.bytes):>10s}  {r.note}" for r in rows]
            lines.append(f"  {'total':18s} {size(total):>10s}")
        where = f"{self.hardware.name}, {size(self.hardware.memory)}{' per device' if self.hardware.gpu else ''}"
        lines.append(f"budget ({where}, {HEADROOM:.0%}): {size(self.budget)}")
        lines.append(self.verdict)
        return "\n".join(lines)


def size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


# a step's trajectories as the learner holds them (token ids, action mask, rollout logprobs as Python tuples):
# 77 B per token measured with tracemalloc on 560-token sequences
STEP_BYTES_PER_TOKEN = 80


def estimate(model: ModelShape, work: Workload, hw: Hardware) -> Plan:
    p, b = model.params, work.dtype_bytes
    trained = model.lora_params(*work.lora) if work.lora else p  # with LoRA, only the adapters have gradients and Adam states
    dp = max(work.data_parallel, 1)
    mixed = b < 4  # bf16 / fp16 weights and gradients, fp32 master weights and Adam states
    optimizer_bytes = trained * (8 + (4 if mixed else 0))
    shard = lambda n, stage: n // dp if work.zero_stage >= stage else n  # noqa: E731
    tokens = min(work.micro_batch_tokens, work.step_tokens)

    def activations(t: int) -> int:
        kept = model.kept_for_backward(t, int(t * work.action_fraction), b, work.gradient_checkpointing)
        return kept + (model.layer_activation_bytes(t, b) if work.gradient_checkpointing else 0)

    sharded = lambda stage: work.zero_stage >= stage and dp > 1  # noqa: E731
    adapters = f", LoRA rank {work.lora[0]}: {count(trained)} trained" if work.lora else ""
    learner = [
        Row(
            "weights", shard((p + (trained if work.lora else 0)) * b, 3),
            f"{count(p)} parameters x {b} B{adapters}" + (f", ZeRO-3: / {dp} ranks" if sharded(3) else ""),
        ),
        Row("gradients", shard(trained * b, 2), ("adapters only" if work.lora else "") + (f" ZeRO-2: / {dp} ranks" if sharded(2) else "")),
        Row("optimizer states", shard(optimizer_bytes, 1), "Adam m, v" + (" + fp32 master" if mixed else "") + (f", ZeRO-1: / {dp} ranks" if sharded(1) else "")),
        Row(
            "activations", activations(tokens),
            f"{tokens} tokens per micro-batch, " + ("checkpointed: + one layer replayed" if work.gradient_checkpointing else "no checkpointing"),
        ),
        Row("LM head, a chunk", model.head_chunk_bytes(int(tokens * work.action_fraction)), f"{HEAD_CHUNK} action positions' fp32 logits, softmax and gradient"),
        Row("step batch", work.step_tokens * STEP_BYTES_PER_TOKEN, f"{work.step_tokens} tokens of trajectories held for the step"),
    ]
    if work.reference_model and not work.lora:  # (with LoRA the reference is the base, adapters off: no copy)
        learner.append(Row("reference model", p * b, "KL on"))
    engine = [
        Row("weights", p * work.engine_dtype_bytes),
        Row(
            "KV cache", model.kv_bytes_per_token(work.engine_dtype_bytes) * work.concurrency * work.sequence_tokens,
            f"{size(model.kv_bytes_per_token(work.engine_dtype_bytes))}/token x {work.concurrency} sequences x {work.sequence_tokens} tokens",
        ),
    ]
    budget = int(hw.memory * HEADROOM)
    k = max(work.ranks_per_device, 1)
    learner_bytes, engine_bytes = k * sum(r.bytes for r in learner), sum(r.bytes for r in engine)
    shared = work.colocated and not work.engine_yields  # (both held at once)
    # a sync run on the local engine (`engine_yields`): the engine gives its memory back while the learner steps, and
    # its rollouts run beside what the learner keeps between steps (weights, optimizer states); it serves the
    # learner's own weights where they are of its dtype (`LentWeights`), a copy of them otherwise
    yields = work.colocated and work.engine_yields
    lent = yields and not work.lora and work.dtype_bytes == work.engine_dtype_bytes
    engine_weights = 0 if lent else p * work.engine_dtype_bytes
    kept = k * sum(r.bytes for r in learner if r.part in ("weights", "optimizer states", "reference model")) if yields else 0
    rollouts = kept + engine_weights + sum(r.bytes for r in engine if r.part == "KV cache")
    need = learner_bytes + engine_bytes if shared else max(learner_bytes, rollouts)
    # the largest concurrency and micro-batch that would fit, the rest unchanged
    engine_room = budget - (learner_bytes if shared else kept) - engine_weights
    per_sequence = model.kv_bytes_per_token(work.engine_dtype_bytes) * work.sequence_tokens
    max_concurrency = max(engine_room // per_sequence, 0)
    fixed = sum(r.bytes for r in learner if r.part not in ("activations", "LM head, a chunk"))
    beside = engine_bytes if shared else 0
    max_micro = _largest(lambda t: k * (fixed + activations(t) + model.head_chunk_bytes(int(t * work.action_fraction))) + beside <= budget)
    fits = need <= budget
    learners = f"learner (x{k} ranks here)" if k > 1 else "learner"
    if shared:
        where = f"{learners} and engine together"
    elif yields:
        serves = " and serves the learner's weights" if lent else ""
        where = (f"the larger of the {learners}'s step and the rollouts beside its weights and optimizer states (a sync step's "
                 f"engine gives its memory back while the learner runs{serves})")
    else:
        where = f"the larger of {learners} and engine"
    # what to change: whichever side does not fit (either one when they share the device)
    micro = f"micro_batch_tokens {max_micro}" if max_micro > 0 else None
    more = f"concurrency {max_concurrency}" if max_concurrency > 0 else None
    if shared:
        fixes = [f for f in (micro, more) if f]
        possible = bool(fixes)
    else:
        needed = [fix for fix, over in ((micro, learner_bytes > budget), (more, rollouts > budget)) if over]
        fixes, possible = [f for f in needed if f], all(needed)
    if fits:
        verdict = f"fits: {where} need {size(need)} of {size(budget)}"
    elif not possible and max(learner, key=lambda r: r.bytes).part == "step batch":
        verdict = (
            f"does NOT fit: {where} need {size(need)} of {size(budget)}, and a step's trajectories alone do not: "
            f"fewer rollout.groups_per_step or a smaller rollout.group_size"
        )
    elif not possible:
        verdict = (
            f"does NOT fit: {where} need {size(need)} of {size(budget)}, and the weights (with the learner's gradients "
            f"and optimizer states) alone do not: more ranks (ZeRO shards them), bf16, or a smaller model"
        )
    else:
        verdict = f"does NOT fit: {where} need {size(need)} of {size(budget)}; {' or '.join(fixes)} (the rest unchanged) would"
    return Plan(hw, learner, engine, fits, verdict, int(max_concurrency), max_micro, budget)


def _largest(fits, high: int = 1 << 30) -> int:
    """The largest t in [0, high] with fits(t) (fits is monotone: more tokens never need less memory)."""
    low = 0
    if not fits(1):
        return 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def workload(config, budgets, prompt_tokens: int, hw: Hardware) -> Workload:
    """The Workload of a run config (`config.RunConfig`) and its environment's budgets."""
    learner, trainer, ranks = config.learner, config.learner_config(), config.learner.ranks
    new_tokens = min(budgets.max_generated_tokens, budgets.max_turns * config.rollout.sampling.max_new_tokens)
    sequence = prompt_tokens + new_tokens
    dp = ranks.ranks if ranks is not None else (hw.devices if hw.gpu else 1)
    stage = trainer.zero_stage if trainer.zero_stage is not None else (0 if dp == 1 else 1)
    return Workload(
        dtype_bytes=2 if (hw.gpu and trainer.dtype in ("bf16", "fp16")) else 4,
        zero_stage=stage,
        data_parallel=dp,
        gradient_checkpointing=learner.gradient_checkpointing,
        micro_batch_tokens=learner.micro_batch_tokens,
        step_tokens=config.rollout.groups_per_step * config.rollout.group_size * sequence // dp,
        action_fraction=new_tokens / sequence,
        reference_model=learner.loss.kl_coef > 0,
        lora=(learner.lora.rank, learner.lora.target_modules) if learner.lora is not None else None,
        concurrency=config.rollout.concurrency,
        sequence_tokens=sequence,
        engine_dtype_bytes=2 if hw.gpu else 4,
        colocated=not hw.gpu or hw.devices == 1,
        engine_yields=config.rollout.mode == "sync" and config.engine.kind == "local",
        ranks_per_device=ranks.ranks_per_node if (ranks is not None and not hw.gpu) else 1,
    )


def require_fits(plan: Plan, config_name: str) -> None:
    if not plan.fits:
        raise LooplineError(f"run {config_name!r} would run out of memory; refused before any work:\n{plan.table()}")
