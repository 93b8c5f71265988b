"""The trainer's settings as plain dataclasses, and the shape of each component a run config chooses by name,
without torch: a run config is validated (and refused, in one line) before the CLI imports torch or Prefect. The
modules that use them re-export them.

A component is a function (or object) of its registry's Protocol below, registered by name in whatever module
defines it (`@POLICY_LOSSES.register("mine")`); the built-ins' names are declared here, their code is in
trainer/advantages.py, trainer/losses.py and trainer/backends.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal, Protocol, TypeAlias

from pydantic import Field, field_validator, model_validator

from loopline.registry import Registry, RegistryName, RegistrySection, Settings

HEAD_CHUNK = 512  # action positions the LM head runs on at once in a learner step (trainer/head.py; loopline/plan.py counts it)

if TYPE_CHECKING:
    import torch

    from loopline.trainer.batch import Padded


class AdvantageEstimator(Protocol):
    """`learner.advantage.estimator`: one group's rewards (at least 2, not all equal) -> each sample's advantage,
    and the standard deviation it divided by (0: none)."""

    def __call__(self, group: torch.Tensor, config: AdvantageSettings, /) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class Surrogate:
    """What a policy loss makes of a micro-batch, per token ([B, T]); the learner applies the off-policy
    correction's weight, the KL term and the aggregation, the same for every loss, and reports the masks."""

    per_token: torch.Tensor  # the policy-gradient loss of each token
    ratio: torch.Tensor  # the importance ratio the loss clipped (a token's, or its sequence's)
    clipped: torch.Tensor  # bool: tokens whose ratio the clip held (no gradient through the ratio)
    dual_clipped: torch.Tensor  # bool: tokens whose loss the dual clip capped (A < 0)


class PolicyLoss(Protocol):
    """`learner.loss.policy_loss` (verl's `policy_loss.loss_mode`): log π_θ (with gradient) and log π_old of a
    micro-batch's rows, each token's advantage and the 0/1 mask of the tokens in the loss, all [B, T] ->
    the per-token surrogate. Values off the mask are meaningless (0 here) and must stay out of the math."""

    def __call__(self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: LossSettings, /) -> Surrogate: ...


class LossAggregation(Protocol):
    """`learner.loss.aggregation`: per-token losses (0 off the mask) -> the micro-batch's share of the step's loss,
    given the step's token and trajectory counts, each row's trajectory's tokens, and the loss settings."""

    def __call__(
        self, per_token: torch.Tensor, mask: torch.Tensor, total_tokens: float | None, total_sequences: float | None,
        sequence_tokens: torch.Tensor | None, config: LossSettings, /,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class CorrectionRule:
    """`learner.loss.correction`, one off-policy correction: the weight it gives each kept token from ρ = π_old/μ
    (per token or per sequence: `correction_level`) and the loss settings, and which tokens it rejects (they leave
    the loss, and its denominators must be known before the first gradient step); None: it rejects none."""

    weight: Callable[[torch.Tensor, LossSettings], torch.Tensor]
    outside: Callable[[torch.Tensor, LossSettings], torch.Tensor] | None = None

    @property
    def rejects(self) -> bool:
        return self.outside is not None


class KLEstimate(Protocol):
    """`learner.loss.kl_estimator`: log(π_ref / π_θ) per token -> that token's estimate of KL(π_θ || π_ref)."""

    def __call__(self, log_ratio: torch.Tensor, /) -> torch.Tensor: ...


LossFn = Callable[["Padded"], "tuple[torch.Tensor, dict[str, float]]"]  # (a micro-batch's share of the step's loss, metrics)


class Backend(Protocol):
    """What a learner backend is (`BuildBackend` makes one): the model's wrapper, the optimizer step, its state."""

    model: torch.nn.Module  # the plain model (for export, config, parameters)
    last_grad_norm: float
    last_skipped: bool  # fp16: the last step overflowed and was skipped by the loss scaler (nothing applied)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, through whatever wraps the model (the DeepSpeed engine, or the model itself); with `keep`
        (sequence positions), only at those positions ([B, len(keep), V])."""

    def call(self, **kwargs) -> Any:
        """The model's output for keyword arguments (cache, position_ids, ...), through the wrapper."""

    def world(self) -> tuple[int, int]:
        """(data-parallel size, this rank)."""

    def optimise(self, micro: list[Padded], loss_of: LossFn, on_error: type[Exception]) -> list[dict[str, float]]:
        """One optimizer step over the step's micro-batches (the same list on every rank); `on_error` is
        the learner's refusal: raised by `loss_of`, or by this when an earlier step broke halfway, or
        (`NonFiniteGradient`) when the gradient norm is NaN or inf. Sets `last_grad_norm`."""

    def save(self, directory: Path, client_state: dict[str, Any]) -> None: ...

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore the model, optimizer and schedule; returns the client state saved with them."""


class BuildBackend(Protocol):
    """`learner.backend`: the model (fp32, train mode), its optimizer and schedule, the learner's settings and
    device -> the backend that steps them."""

    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, config: LearnerConfig, device: torch.device, /) -> Backend: ...


# Components chosen by name: the built-ins declared here (no torch), implemented and registered by
# trainer/advantages.py, trainer/losses.py and trainer/backends.py; a component registered anywhere else is a valid name too.
ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", "learner.advantage.estimator", ("grpo", "dr_grpo", "rloo"))
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "learner.loss.policy_loss", ("vanilla", "gspo"))
AGGREGATIONS: Registry[LossAggregation] = Registry(
    "loss aggregation", "learner.loss.aggregation", ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
)
CORRECTIONS: Registry[CorrectionRule] = Registry("off-policy correction", "learner.loss.correction", ("none", "tis", "mis", "rejection"))
KL_ESTIMATORS: Registry[KLEstimate] = Registry("KL estimator", "learner.loss.kl_estimator", ("k1", "k3"))
BACKENDS: Registry[BuildBackend] = Registry("learner backend", "learner.backend", ("deepspeed", "torch"))
StdKind = Literal["population", "sample"]
DegenerateHandling = Literal["drop", "zero"]
CorrectionLevel = Literal["token", "sequence"]
CorrectionBounds = Literal["upper", "two_sided"]
LRSchedule = Literal["constant", "cosine", "linear"]
BackendName: TypeAlias = str  # (a name registered in BACKENDS)
Dtype = Literal["fp32", "bf16", "fp16"]


class AdvantageSettings(Settings):
    """`learner.advantage`: what every estimator shares; an estimator's own settings subclass this (GRPO's divisor)."""

    estimator: Annotated[str, RegistryName(ESTIMATORS)] = Field(
        "grpo", description="grpo: (r - group mean) / (std + eps); dr_grpo: r - group mean (no std); rloo: leave-one-out baseline",
    )
    degenerate: DegenerateHandling = Field(
        "zero", description="a group whose samples all scored the same: zero (advantage 0: trained on, no signal) or drop (left out)",
    )


class GRPOSettings(AdvantageSettings):
    std: StdKind = Field("sample", description="GRPO's divisor: the sample standard deviation (1/(n-1), as verl's torch.std and TRL) or the population one (1/n)")
    eps: float = Field(1e-6, gt=0, le=1, description="added to the standard deviation (verl 1e-6; TRL 1e-4)")


class LossSettings(Settings):
    """`learner.loss`: what every policy loss, correction and aggregation shares; each may bring settings of its own
    (the vanilla loss's dual clip, the rejecting corrections' bounds, Dr. GRPO's constant length), which subclass this."""

    policy_loss: Annotated[str, RegistryName(POLICY_LOSSES)] = Field(
        "vanilla", description="vanilla: PPO's clipped token ratio π_θ/π_old (dual-clipped, as verl's vanilla); gspo: GSPO's sequence ratio, "
        "the geometric mean of the row's token ratios, clipped (verl gspo, TRL importance_sampling_level=sequence; its recipe "
        "clips at 3e-4 / 4e-4 with seq_mean_token_mean)",
    )
    clip_low: float = Field(0.2, description="the ratio π_θ/π_old is clipped below at 1 - clip_low (verl clip_ratio_low, TRL epsilon)")
    clip_high: float = Field(0.28, description="... and above at 1 + clip_high: asymmetric, DAPO's clip-higher (verl clip_ratio_high, TRL epsilon_high)")
    # Rejected tokens leave the loss entirely (its denominators and the KL term too).
    correction: Annotated[str, RegistryName(CORRECTIONS)] = Field(
        "tis", description="the π_old/μ correction of an off-policy rollout (verl's rollout correction): tis: weight min(ρ, cap); mis: "
        "weight ρ, tokens (or sequences) outside the bounds rejected; rejection: weight 1, outside the bounds rejected; none: weight 1",
    )
    correction_level: CorrectionLevel = Field("token", description="token: ρ per token; sequence: ρ is the product of the sequence's token ratios")
    correction_cap: float = Field(2.0, description="C: the truncation (tis) or the upper rejection bound (mis, rejection)")
    aggregation: Annotated[str, RegistryName(AGGREGATIONS)] = Field(
        "token_mean", description="how per-token losses become the loss: token_mean (every token weighs the same; verl token-mean, TRL bnpo), "
        "seq_mean_token_sum, seq_mean_token_mean (TRL grpo), seq_mean_token_sum_norm (Dr. GRPO)",
    )
    kl_coef: float = Field(0.0, description="> 0 adds a KL penalty to the frozen reference policy (the run's initial weights; TRL beta)")
    kl_estimator: Annotated[str, RegistryName(KL_ESTIMATORS)] = Field(
        "k3", description="k3 (low variance, capped at 10 a token as verl's low_var_kl) or k1 (the log-ratio)",
    )

    @model_validator(mode="after")
    def _in_range(self) -> LossSettings:  # (said with what the setting is, where pydantic's bounds would say only "Input should be ...")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1) (the ratio's floor is 1 - clip_low; verl's default 0.2), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0 (the ratio's ceiling is 1 + clip_high; verl's default 0.2), got {self.clip_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0 (a negative one rewards moving away from the reference), got {self.kl_coef}")
        if self.correction_cap <= 0:
            raise ValueError(f"correction_cap must be > 0, got {self.correction_cap}")
        return self

    def for_run(self, max_new_tokens: int) -> LossSettings:
        """These settings with what a component derives from the run filled in (`sampling.max_new_tokens`)."""
        return self


class DualClipSettings(LossSettings):
    clip_ratio_c: float | None = Field(3.0, description="dual clip (verl's clip_ratio_c): for A < 0 the loss is capped at c * |A|, no gradient beyond; null: off")

    @model_validator(mode="after")
    def _above_one(self) -> DualClipSettings:
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (verl's default is 3), got {self.clip_ratio_c}")
        return self


class RejectionSettings(LossSettings):
    correction_bounds: CorrectionBounds = Field("upper", description="upper: reject ρ > C; two_sided: also ρ < 1/C")

    @model_validator(mode="after")
    def _two_sided_needs_room(self) -> RejectionSettings:
        if self.correction_bounds == "two_sided" and self.correction_cap <= 1.0:
            raise ValueError("a two-sided rejection needs correction_cap > 1 (the bounds are [1/C, C])")
        return self


class NormLengthSettings(LossSettings):
    norm_length: int | None = Field(None, ge=1, description="seq_mean_token_sum_norm's constant length L (default: sampling.max_new_tokens)")

    def for_run(self, max_new_tokens: int) -> LossSettings:
        return self if self.norm_length is not None else self.model_copy(update={"norm_length": max_new_tokens})  # Dr. GRPO's L


ESTIMATORS.declare_settings("grpo", GRPOSettings)
POLICY_LOSSES.declare_settings("vanilla", DualClipSettings)
CORRECTIONS.declare_settings("mis", RejectionSettings)
CORRECTIONS.declare_settings("rejection", RejectionSettings)
AGGREGATIONS.declare_settings("seq_mean_token_sum_norm", NormLengthSettings)
ADVANTAGE_SECTION = RegistrySection(ESTIMATORS, key="estimator")
LOSS_SECTION = RegistrySection(POLICY_LOSSES, key="policy_loss", correction=CORRECTIONS, aggregation=AGGREGATIONS, kl_estimator=KL_ESTIMATORS)


def advantage_settings(**values: Any) -> AdvantageSettings:
    """`learner.advantage` from its settings, as its estimator's own model (`advantage_settings(estimator="rloo")`)."""
    return ADVANTAGE_SECTION.validate(AdvantageSettings, values)  # type: ignore[return-value]


def loss_settings(**values: Any) -> LossSettings:
    """`learner.loss` from its settings, as its components' own models combined."""
    return LOSS_SECTION.validate(LossSettings, values)  # type: ignore[return-value]


class LoraConfig(Settings):
    """Low-rank adapters (peft) on a frozen base. Defaults are verl's (`lora_alpha` 16, `target_modules`
    all-linear: every linear layer but the output head); rank has none there (0: off), so it must be given."""

    rank: int = Field(ge=1, description="the adapters' rank R (required: verl's lora_rank, TRL's LoraConfig r)")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank (verl's and peft's lora_alpha)")
    # Only 0 for now: dropout draws from the process's random stream, which rollouts and evaluations in the same
    # process also draw from, so a replay or a resume's rebuild could not reproduce a step bit for bit.
    dropout: float = Field(0.0, description="only 0: a step with dropout could not be replayed bit for bit")
    target_modules: str | tuple[str, ...] = Field(
        "all-linear", min_length=1, description="all-linear (every linear layer but the output head) or module names, e.g. [q_proj, v_proj]",
    )

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, dropout: float) -> float:
        if dropout != 0:
            raise ValueError("only 0 is supported (a step with dropout could not be replayed bit for bit)")
        return dropout


class RankLaunch(Settings):
    """Data-parallel learner ranks started through DeepSpeed's launcher (`deepspeed`); rank 0 runs the flow."""

    nodes: int = Field(1, ge=1, description="hosts the ranks run on (more than 1: a hostfile, and pdsh or `args: [--launcher, ...]`)")
    ranks_per_node: int = Field(2, ge=1, description="ranks on each host (on a GPU node: its GPUs)")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile ('HOST slots=N' lines; the first host runs rank 0)")
    master_port: int | None = Field(None, ge=1, le=65535, description="rank 0's rendezvous port; default: a free one on this host")
    args: list[str] = Field(default_factory=list, description="more launcher flags, e.g. [--launcher, openmpi] or [--ssh_port, '2222']")

    @model_validator(mode="after")
    def _many_hosts_need_a_hostfile(self) -> RankLaunch:
        if self.nodes > 1 and not self.hostfile:
            raise ValueError("nodes > 1: name the hosts in a hostfile (DeepSpeed's format: 'HOST slots=N' per line)")
        if self.nodes > 1 and self.master_port is None:
            raise ValueError("nodes > 1: set master_port (a port free on the hostfile's first host)")
        return self

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


class LearnerSettings(Settings):
    """The learner: optimizer, loss, advantage, batches, checkpoints (the run config's `learner:` section, and what
    the trainer is built with, with what the run derives: `LearnerConfig`). Its backend's own settings subclass this (DeepSpeed's ranks,
    precision and ZeRO stage); a backend of your own registers its model with it."""

    lr: float = Field(3e-4, gt=0, description="AdamW's learning rate (peak, after any warm-up)")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up of the learning rate over this many optimizer steps")
    lr_schedule: LRSchedule = Field(
        "constant", description="after warm-up: constant (verl's default), or cosine / linear decay over the run's steps x minibatches",
    )
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="where cosine / linear decay ends, as a fraction of lr (verl's min_lr_ratio; TRL's end at 0 too)")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW's decoupled weight decay (TRL's default 0; verl's actor 0.01)")
    backend: Annotated[str, RegistryName(BACKENDS)] = Field(
        "deepspeed", description="deepspeed (ZeRO, several ranks, bf16/fp16: its settings below) or torch (a plain AdamW loop "
        "in this process, fp32)",
    )
    micro_batch_tokens: int = Field(
        16384, ge=1, description="tokens in one forward/backward pass; a step's rows are packed into micro-batches that run at most this many (rows padded to the longest; with share_prefix, each shared prompt once and every row's rest; a longer row is one of its own; memory, not the update)",
    )
    minibatches: int = Field(1, ge=1, description="optimizer steps per learner step, each on a slice of the step's groups (verl's ppo_mini_batch_size; π_old anchors all of them)")
    share_prefix: bool = Field(True, description="run a prompt shared by a group's samples once per micro-batch, which keeps them together (same update, fewer FLOPs; trainer/prefix.py)")
    gradient_checkpointing: bool = Field(
        True, description="keep each layer's input only and replay the layer in backward (activations ~1/10, ~one more forward; TRL's default)",
    )
    checkpoint_every: int = Field(
        4, ge=1, description="full learner checkpoint every N steps (and at the last); a resume replays the recorded steps since"
    )
    export_every: int | None = Field(
        None, ge=1,
        description="write version N's weights to disk when N is a multiple of this (and at every evaluation and the last); "
        "default: 1 when another process loads each version (SGLang, `loopline worker`), else checkpoint_every - the "
        "in-process engine takes the others from the learner's memory",
    )
    keep_checkpoints: int = Field(2, ge=1, description="full checkpoints kept on disk (the newest)")
    keep_exports: int = Field(3, ge=1, description="newest weight exports kept, besides evaluated versions'")
    advantage: Annotated[AdvantageSettings, ADVANTAGE_SECTION] = Field(
        default_factory=advantage_settings, description="the group advantage: {estimator: grpo | dr_grpo | rloo, degenerate: zero | drop}, "
        "then the estimator's own settings (GRPO's std and eps)",
    )
    loss: Annotated[LossSettings, LOSS_SECTION] = Field(
        default_factory=loss_settings, description="the policy loss: clip_low / clip_high (0.2 / 0.28), the off-policy correction (tis, "
        "cap 2), aggregation (token_mean), kl_coef (0), then the chosen components' own settings (vanilla's dual clip, 3)",
    )
    lora: LoraConfig | None = Field(
        None, description="train low-rank adapters on the frozen policy ({rank: R, alpha: 16, target_modules: all-linear}); "
        "checkpoints hold the adapters, exports and weight syncs the merged model. Unset: every weight",
    )

    @property
    def ranks(self) -> RankLaunch | None:
        """Several data-parallel ranks to launch (rank 0 runs the flow); None: this process alone."""
        return None


class DeepSpeedSettings(LearnerSettings):
    """DeepSpeed: ZeRO, several ranks, bf16 / fp16 mixed precision."""

    zero_stage: int | None = Field(
        None, ge=0, le=3, description="DeepSpeed ZeRO stage; default 0 with one learner rank (ZeRO's flat fp32 copies partition nothing "
        "there), 1 with several or with dtype: fp16",
    )
    dtype: Dtype = Field(
        "fp32", description="bf16: mixed precision on a GPU (fp32 master weights and Adam states); fp16: the same for GPUs without "
        "bf16 (V100, T4), with dynamic loss scaling: a step whose gradients overflow is skipped (metric fp16_skipped_steps)",
    )
    launch: RankLaunch | None = Field(
        None, description="train on several data-parallel ranks (DeepSpeed's launcher; rank 0 runs the flow); unset: this process alone",
    )

    @property
    def ranks(self) -> RankLaunch | None:
        return self.launch

    @model_validator(mode="after")
    def _fp16_under_zero(self) -> DeepSpeedSettings:
        if self.dtype == "fp16" and self.zero_stage == 0:
            raise ValueError("dtype: fp16 runs under ZeRO (zero_stage: 1 or more, the default with fp16): ZeRO's gradient norm is the unscaled one")
        return self


BACKENDS.declare_settings("deepspeed", DeepSpeedSettings)  # (torch: the base, fp32 in this process)
LEARNER_SECTION = RegistrySection(BACKENDS, key="backend")


class LearnerConfig(DeepSpeedSettings):
    """What a learner is built with: its settings (`learner:`; under another backend DeepSpeed's at their defaults)
    and what the run derives for it (`RunConfig.learner_config`)."""

    # a decay reaches min_lr_ratio * lr at optimizer step decay_steps (a run's: its steps x minibatches, as verl's
    # total_training_steps, TRL's max_steps)
    decay_steps: int | None = Field(None, ge=1, description="the optimizer step a decay ends at (the run's steps x minibatches)")
    temperature: float = Field(1.0, ge=0, description="the rollout's sampling temperature: logprobs are log_softmax(logits / T)")
    seed: int = Field(0, description="the run's seed")
    grad_clip: float = Field(1.0, gt=0, description="the gradients' global norm is clipped to this")

    @model_validator(mode="after")
    def _decay_has_an_end(self) -> LearnerConfig:
        if (self.lr_schedule == "constant") != (self.decay_steps is None):
            raise ValueError(f"lr_schedule {self.lr_schedule} with decay_steps {self.decay_steps}: a decay (cosine, linear) ends at decay_steps, constant has none")
        return self
