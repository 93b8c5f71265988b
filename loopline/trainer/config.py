"""The trainer's settings as plain dataclasses, without torch: a run config is validated (and refused, in one
line) before the CLI imports torch or Prefect. The modules that use them re-export them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from loopline.registry import Registry

# Components chosen by name: the built-ins declared here (no torch), implemented and registered by
# trainer/advantages.py and trainer/losses.py; a component registered anywhere else is a valid name too.
ESTIMATORS: Registry = Registry("advantage estimator", "learner.advantage.estimator", ("grpo", "dr_grpo", "rloo"))
AGGREGATIONS: Registry = Registry(
    "loss aggregation", "learner.loss.aggregation", ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
)
CORRECTIONS: Registry = Registry("off-policy correction", "learner.loss.correction", ("none", "tis", "mis", "rejection"))
KL_ESTIMATORS: Registry = Registry("KL estimator", "learner.loss.kl_estimator", ("k1", "k3"))
BACKENDS: Registry = Registry("learner backend", "learner.backend", ("deepspeed", "torch"))  # (trainer/backends.py)
# (each a registered name)
Estimator: TypeAlias = str
Aggregation: TypeAlias = str
OffPolicyCorrection: TypeAlias = str
KLEstimator: TypeAlias = str
StdKind = Literal["population", "sample"]
DegenerateHandling = Literal["drop", "zero"]
CorrectionLevel = Literal["token", "sequence"]
CorrectionBounds = Literal["upper", "two_sided"]
LRSchedule = Literal["constant", "cosine", "linear"]
BackendName: TypeAlias = str  # (a name registered in BACKENDS)
Dtype = Literal["fp32", "bf16", "fp16"]


def setting(default, description: str):
    """A default with what it is for (read by pydantic into `loopline schema`, and by the docs' reference)."""
    return field(default=default, metadata={"description": description})


@dataclass(frozen=True)
class AdvantageConfig:
    estimator: Estimator = ESTIMATORS.setting_field("grpo", "grpo: (r - group mean) / (std + eps); dr_grpo: r - group mean (no std); rloo: leave-one-out baseline")
    std: StdKind = setting("sample", "GRPO's divisor: the sample standard deviation (1/(n-1), as verl's torch.std and TRL) or the population one (1/n)")
    eps: float = setting(1e-6, "added to the standard deviation (verl 1e-6; TRL 1e-4)")
    degenerate: DegenerateHandling = setting("zero", "a group whose samples all scored the same: zero (advantage 0: trained on, no signal) or drop (left out)")

    def __post_init__(self) -> None:
        ESTIMATORS.check(self.estimator)


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = setting(0.2, "the ratio π_θ/π_old is clipped below at 1 - clip_low (verl clip_ratio_low, TRL epsilon)")
    clip_high: float = setting(0.28, "... and above at 1 + clip_high: asymmetric, DAPO's clip-higher (verl clip_ratio_high, TRL epsilon_high)")
    clip_ratio_c: float | None = setting(3.0, "dual clip (verl's clip_ratio_c): for A < 0 the loss is capped at c * |A|, no gradient beyond; null: off")
    # Rejected tokens leave the loss entirely (its denominators and the KL term too).
    correction: OffPolicyCorrection = CORRECTIONS.setting_field(
        "tis", "the π_old/μ correction of an off-policy rollout (verl's rollout correction): tis: weight min(ρ, cap); mis: "
        "weight ρ, tokens (or sequences) outside the bounds rejected; rejection: weight 1, outside the bounds rejected; none: weight 1",
    )
    correction_level: CorrectionLevel = setting("token", "token: ρ per token; sequence: ρ is the product of the sequence's token ratios")
    correction_cap: float = setting(2.0, "C: the truncation (tis) or the upper rejection bound (mis, rejection)")
    correction_bounds: CorrectionBounds = setting("upper", "upper: reject ρ > C; two_sided: also ρ < 1/C")
    aggregation: Aggregation = AGGREGATIONS.setting_field(
        "token_mean", "how per-token losses become the loss: token_mean (every token weighs the same; verl token-mean, TRL bnpo), "
        "seq_mean_token_sum, seq_mean_token_mean (TRL grpo), seq_mean_token_sum_norm (Dr. GRPO)",
    )
    norm_length: int | None = setting(None, "seq_mean_token_sum_norm's constant length L (default: sampling.max_new_tokens)")
    kl_coef: float = setting(0.0, "> 0 adds a KL penalty to the frozen reference policy (the run's initial weights; TRL beta)")
    kl_estimator: KLEstimator = KL_ESTIMATORS.setting_field("k3", "k3 (low variance, capped at 10 a token as verl's low_var_kl) or k1 (the log-ratio)")

    def __post_init__(self) -> None:
        CORRECTIONS.check(self.correction)
        AGGREGATIONS.check(self.aggregation)
        KL_ESTIMATORS.check(self.kl_estimator)
        for name in ("clip_low", "clip_high", "correction_cap", "kl_coef", "clip_ratio_c"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1) (the ratio's floor is 1 - clip_low; verl's default 0.2), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0 (the ratio's ceiling is 1 + clip_high; verl's default 0.2), got {self.clip_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0 (a negative one rewards moving away from the reference), got {self.kl_coef}")
        if self.correction_cap <= 0:
            raise ValueError(f"correction_cap must be > 0, got {self.correction_cap}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (verl's default is 3), got {self.clip_ratio_c}")
        if self.correction_cap <= 1.0 and self.correction in ("mis", "rejection") and self.correction_bounds == "two_sided":
            raise ValueError("a two-sided rejection needs correction_cap > 1 (the bounds are [1/C, C])")
        if self.aggregation == "seq_mean_token_sum_norm" and self.norm_length is not None and self.norm_length < 1:
            raise ValueError("norm_length must be a positive number of tokens")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (peft) on a frozen base. Defaults are verl's (`lora_alpha` 16, `target_modules`
    all-linear: every linear layer but the output head); rank has none there (0: off), so it must be given."""

    rank: int = field(metadata={"description": "the adapters' rank R (required: verl's lora_rank, TRL's LoraConfig r)"})
    alpha: float = setting(16.0, "the update is scaled by alpha / rank (verl's and peft's lora_alpha)")
    # Only 0 for now: dropout draws from the process's random stream, which rollouts and evaluations in the same
    # process also draw from, so a replay or a resume's rebuild could not reproduce a step bit for bit.
    dropout: float = setting(0.0, "only 0: a step with dropout could not be replayed bit for bit")
    target_modules: str | tuple[str, ...] = setting("all-linear", "all-linear (every linear layer but the output head) or module names, e.g. [q_proj, v_proj]")

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if self.dropout != 0:
            raise ValueError("dropout: only 0 is supported (a step with dropout could not be replayed bit for bit)")
        if not self.target_modules:
            raise ValueError("target_modules: name at least one module, or all-linear")


@dataclass(frozen=True)
class LearnerConfig:
    """The learner's settings. The run config's `learner:` section takes the defaults and meanings of the ones it
    shares from here (one place each); `decay_steps`, `temperature` and `seed` it derives from the run."""

    lr: float = setting(3e-4, "AdamW's learning rate (peak, after any warm-up)")
    warmup_steps: int = setting(0, "linear warm-up of the learning rate over this many optimizer steps")
    lr_schedule: LRSchedule = setting(
        "constant", "after warm-up: constant (verl's default), or cosine / linear decay over the run's steps x minibatches"
    )
    # a decay reaches min_lr_ratio * lr at optimizer step decay_steps (a run's: its steps x minibatches, as verl's
    # total_training_steps, TRL's max_steps)
    decay_steps: int | None = None
    min_lr_ratio: float = setting(0.0, "where cosine / linear decay ends, as a fraction of lr (verl's min_lr_ratio; TRL's end at 0 too)")
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay (TRL's default 0; verl's actor 0.01)")
    grad_clip: float = 1.0
    temperature: float = 1.0  # must equal the rollout's: logprobs are log_softmax(logits / T)
    micro_batch_tokens: int = setting(
        16384, "tokens in one forward/backward pass; a step's rows are packed into micro-batches of at most this many (memory, not the update)"
    )
    minibatches: int = setting(1, "optimizer steps per learner step, each on a slice of the step's groups (verl's ppo_mini_batch_size; π_old anchors all of them)")
    share_prefix: bool = setting(True, "run a prompt shared by a group's samples once (same update, fewer FLOPs; trainer/prefix.py)")
    gradient_checkpointing: bool = setting(
        True, "keep each layer's input only and replay the layer in backward (activations ~1/10, ~one more forward; TRL's default)"
    )
    zero_stage: int | None = setting(
        None, "DeepSpeed ZeRO stage; default 0 with one learner rank (ZeRO's flat fp32 copies partition nothing there), 1 with "
        "several or with dtype: fp16",
    )
    dtype: Dtype = setting(
        "fp32", "bf16: mixed precision on a GPU (fp32 master weights and Adam states); fp16: the same for GPUs without "
        "bf16 (V100, T4), with dynamic loss scaling: a step whose gradients overflow is skipped (metric fp16_skipped_steps)",
    )
    seed: int = 0
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    lora: LoraConfig | None = None  # train adapters only (trainer/lora.py); None: every weight

    def __post_init__(self) -> None:
        if (self.lr_schedule == "constant") != (self.decay_steps is None):
            raise ValueError(f"lr_schedule {self.lr_schedule} with decay_steps {self.decay_steps}: a decay (cosine, linear) ends at decay_steps, constant has none")
