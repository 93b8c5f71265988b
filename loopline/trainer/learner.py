"""The learner: one policy update per call, on a DeepSpeed or plain-torch backend (`trainer/backends.py`).

A step recomputes π_old for the whole batch first (no grad; it is also the
"learner-recomputed" logprobs compared with the rollout's μ), then takes
`minibatches` optimizer steps over token-budgeted micro-batches with
gradient accumulation. Every micro-batch's loss is its exact share of the
step's loss (see `aggregate`), so micro-batching changes nothing but memory.
Checkpoints and exports are written by `trainer/checkpoint.py`.
"""

from __future__ import annotations

import contextlib
import functools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from loopline.types import TrainedSample
from loopline.trainer import checkpoint, head, losses, lora, prefix
from loopline.trainer.advantages import Advantages, compute_advantages
from loopline.trainer.backends import Backend, BackendName, Frozen, NonFiniteGradient, build_backend
from loopline.trainer.batch import Padded, TrainSequence, micro_batches, pad, trajectory_index
from loopline.trainer.losses import Correction, aggregate, logprob_gap, off_policy_correction, policy_loss
from loopline.trainer.config import LearnerConfig  # noqa: F401 (re-exported: a run config needs no torch)
from loopline.trainer.schedule import lr_factor

# The learner's own per-token metrics beside the loss's (`losses.TOKEN_MEANS`), combined the same way: the
# policy's entropy at the trained tokens (verl's `actor/entropy`, TRL's `entropy`), from the loss's forward.
OWN_TOKEN_MEANS = ("entropy",)


class LearnerError(ValueError):
    """The step or checkpoint is refused (bad batch, NaN, mismatched checkpoint); nothing was updated."""


class RefusedUpdate(LearnerError):
    """The step's gradient norm was not finite. The torch backend and DeepSpeed without ZeRO refuse it before
    the optimizer; with ZeRO (stage >= 1) DeepSpeed knows the norm only after its step, so this learner then
    refuses every later step (a new process restores the last checkpoint). Either way nothing is committed."""

    def __init__(self, message: str, metrics: dict[str, float]):
        super().__init__(message)
        self.metrics = metrics


@dataclass(frozen=True)
class StepResult:
    skipped: str | None  # why the step did nothing, or None
    metrics: dict[str, float]
    samples: dict[object, TrainedSample] = field(default_factory=dict)  # trajectory id -> what it contributed


def _checkpoint_activations(model) -> None:
    """Gradient checkpointing: a decoder layer's activations (its MLP's 4 x intermediate-size tensors, the
    attention's) are the learner's largest memory, ~25 KB per token per layer for SmolLM2 in fp32; keeping
    only each layer's input and replaying the layer in backward costs about one more forward pass.
    transformers drops the KV cache under checkpointing, because a replayed layer would write it twice;
    the prefix-sharing caches (`trainer/prefix.py`) give the same answer on a replay, so the layers keep them."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not model.supports_gradient_checkpointing:
        raise LearnerError(f"{type(model).__name__} does not support gradient checkpointing; set learner.gradient_checkpointing: false")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            layer._can_checkpoint_with_cache = True


@contextlib.contextmanager
def computing_threads(threads: int | None):
    """Compute with `threads` intra-op threads (None: as set). CPU reductions split their work by the thread
    count, so a step replayed with another count than it was trained with differs in the last bits."""
    before = torch.get_num_threads()
    if threads and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def bf16_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def fp16_supported() -> bool:
    return torch.cuda.is_available()


@dataclass
class _Step:
    """One rl_step's batch as it moves through the stages: its advantages and micro-batches, then π_old and the
    π_old/μ correction of each micro-batch (fixed for the whole step), then the loss's denominators."""

    adv: Advantages
    base: dict[str, float]  # (metrics known before anything is trained)
    keep: list[int]  # indexes in the batch of the sequences trained
    seqs: list[TrainSequence]  # those sequences
    trajectory_of: list[int]  # index in `seqs` -> its trajectory
    advantages: torch.Tensor  # [len(seqs)]
    micro: list[Padded]
    reuse: bool  # π_old is the loss's own forward, detached (one optimizer step, no rejection)
    loss: losses.LossSettings
    device: torch.device
    old: dict[int, torch.Tensor] = field(default_factory=dict)  # id(micro-batch) -> π_old
    corrections: dict[int, Correction] = field(default_factory=dict)
    trajectory_tokens: list[float] = field(default_factory=list)

    @classmethod
    def empty(cls, adv: Advantages) -> "_Step":
        return cls(adv, {}, [], [], [], torch.zeros(0), [], False, losses.loss_settings(), torch.device("cpu"))

    def anchor(self, batch: Padded, logp: torch.Tensor) -> None:
        """π_old of one micro-batch, and its π_old/μ correction."""
        if not torch.isfinite(logp[batch.target_mask.bool()]).all():
            raise LearnerError("the policy's own logprobs are NaN or inf on action tokens; refusing the update")
        self.old[id(batch)] = logp
        self.corrections[id(batch)] = off_policy_correction(
            logp, batch.behaviour_logprobs.to(self.device), batch.target_mask.to(self.device), self.loss
        )

    def counted(self, batch: Padded) -> torch.Tensor:
        """The tokens of a micro-batch in the loss (reused: nothing is rejected, every action token)."""
        return batch.target_mask.bool() if self.reuse else self.corrections[id(batch)].kept

    def count_trajectory_tokens(self) -> None:
        """Sequence-level aggregations weigh a trajectory once whatever its number of chains: the count is of
        trajectories, and a seq-mean-token-mean divides each chain's token sum by its trajectory's tokens."""
        self.trajectory_tokens = [0.0] * (max(self.trajectory_of) + 1)
        for b in self.micro:
            for row, j in enumerate(b.rows):
                self.trajectory_tokens[self.trajectory_of[j]] += float(self.counted(b)[row].sum())

    def minibatches(self, n: int) -> list[list[Padded]]:
        return [g for g in (self.micro[i::n] for i in range(n)) if g]

    def denominators(self, group: list[Padded]) -> tuple[float, float]:
        """A minibatch's tokens in the loss, and its trajectories with any."""
        tokens = float(sum(int(self.counted(b).sum()) for b in group))
        trajectories = {self.trajectory_of[j] for b in group for row, j in enumerate(b.rows) if self.counted(b)[row].any()}
        return tokens, float(len(trajectories))


def _mean_group_std(firsts: Sequence[TrainSequence]) -> float:
    """TRL's `reward_std`: each group's sample standard deviation of its rewards, averaged over the groups."""
    groups: dict[object, list[float]] = {}
    for s in firsts:
        groups.setdefault(s.group_id, []).append(s.reward)
    stds = [float(np.std(rewards, ddof=1)) for rewards in groups.values() if len(rewards) > 1]
    return sum(stds) / len(stds) if stds else 0.0


class Learner:
    def __init__(self, model_dir: str | Path, config: LearnerConfig = LearnerConfig(), backend: BackendName | None = None):
        from transformers import AutoModelForCausalLM

        if config.dtype == "bf16" and not bf16_supported():
            raise LearnerError("bf16 was asked for, but this machine has no bf16-capable GPU; use dtype fp32")
        if config.dtype == "fp16" and not fp16_supported():
            raise LearnerError("fp16 was asked for, but this machine has no CUDA GPU; use dtype fp32")
        self.config, self.backend_name, self.model_dir = config, backend or config.backend, Path(model_dir)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.train()
        if config.gradient_checkpointing:
            _checkpoint_activations(model)
        if config.lora is not None:
            try:
                lora.apply(model, config.lora)
            except ValueError as exc:
                raise LearnerError(str(exc)) from None
        trained = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapters alone
        optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)
        self._lr = lambda: float(optimizer.param_groups[0]["lr"])  # (the schedule's current rate; DeepSpeed steps it on this optimizer)
        schedule = functools.partial(
            lr_factor, warmup_steps=config.warmup_steps, schedule=config.lr_schedule, decay_steps=config.decay_steps, min_ratio=config.min_lr_ratio
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        self.backend = build_backend(self.backend_name, model, optimizer, scheduler, config, self.device)
        self.model = self.backend.model
        self.steps_done = 0
        self._plain_head: bool | None = None  # (`_scoring`)
        # KL's reference: the run's initial weights (the learner is always built from them), frozen; with LoRA
        # the base under the adapters is exactly that, read with the adapters off
        self.reference: Frozen | lora.BaseOf | None = None
        if config.loss.kl_coef > 0 and config.lora is not None:
            self.reference = lora.BaseOf(self.model)
        elif config.loss.kl_coef > 0:
            reference_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.dtype, torch.float32)
            self.reference = Frozen(AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=reference_dtype), self.device)

    # ------------------------------------------------------------------ forward

    def _logprobs(self, batch: Padded, model: Frozen | lora.BaseOf | None = None, entropy: list | None = None) -> torch.Tensor:
        """log π(token t+1 | tokens ≤ t) at every position t where some row has an action token ([B, L-1],
        0 elsewhere), of the policy (or of `model`, the reference). Only those positions go through the LM
        head (`logits_to_keep`): the prompt's and the tool outputs' logits over the whole vocabulary are never
        made, which dominated time and memory; and those through it a chunk at a time (`head.py`). `entropy`:
        given, the policy's entropy at the same places is appended to it (a metric, no gradient)."""
        via = model or self.backend
        with self._scoring(via) as score:
            shared = prefix.plan(batch) if self.config.share_prefix else None
            if shared is not None:
                layers = self.model.config.get_text_config().num_hidden_layers
                return prefix.shared_prefix_logprobs(via.call, layers, batch, shared, score, self.device, entropy)
            out = torch.zeros(batch.target_mask.shape, dtype=torch.float32, device=self.device)
            positions = batch.target_mask.bool().any(0).nonzero().squeeze(-1)
            if positions.numel() == 0:
                if entropy is not None:
                    entropy.append(torch.zeros_like(out))
                return out
            output = via.forward(batch.input_ids.to(self.device), batch.attention_mask.to(self.device), keep=positions.to(self.device))
            entropies: list = []
            picked = score(output, batch.input_ids[:, 1:][:, positions].to(self.device), entropies if entropy is not None else None,
                           batch.target_mask[:, positions].bool().to(self.device))
            if entropy is not None:
                entropy.append(torch.zeros_like(out).index_copy(1, positions.to(self.device), entropies[0]))
            return out.index_copy(1, positions.to(self.device), picked)

    @contextlib.contextmanager
    def _scoring(self, via: Frozen | lora.BaseOf | Backend):
        """What makes logprobs of the model's output: its last hidden states, through the head in chunks, where
        the model's head is plain (checked once, at the first step); its logits otherwise."""
        if self._plain_head is None:
            self._plain_head = head.plain_head(self.model)
        if not self._plain_head:
            yield lambda logits, targets, entropy, at: head.logits_logprobs(logits, targets, self.config.temperature, entropy)
            return
        with head.states_out(via.model) as linear:
            yield lambda states, targets, entropy, at: head.states_logprobs(states, linear, targets, self.config.temperature, entropy, at)

    def _summarise(self, step_metrics: list[dict[str, float]]) -> dict[str, float]:
        """The loss's metrics over every rank's micro-batches, each combined as `losses` declares it."""
        token_means = losses.TOKEN_MEANS + OWN_TOKEN_MEANS
        undeclared = {k for m in step_metrics for k in m} - set(losses.SUMMED + losses.MAXIMA + token_means)
        if undeclared:
            raise LearnerError(f"the loss returned metrics that trainer/losses.py does not declare: {', '.join(sorted(undeclared))}")
        sums = torch.tensor(
            [sum(m[k] for m in step_metrics) for k in losses.SUMMED]
            + [sum(m[k] * m["tokens"] for m in step_metrics) for k in token_means],
            dtype=torch.float64,
        )
        maxima = torch.tensor([max((m[k] for m in step_metrics), default=1.0) for k in losses.MAXIMA], dtype=torch.float64)
        if self.backend.world()[0] > 1:
            torch.distributed.all_reduce(sums)
            torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX)
        totals = dict(zip(losses.SUMMED + token_means, sums.tolist()))
        n = max(totals["tokens"], 1.0)
        return {"loss": totals["loss"], **{k: totals[k] / n for k in token_means}, **dict(zip(losses.MAXIMA, maxima.tolist()))}

    # ------------------------------------------------------------------ steps

    def _logprob_gaps(self, step: "_Step", version: int | None) -> dict:
        recomputed, behaviour, fresh = [], [], []
        for b in step.micro:
            if id(b) not in step.old:  # another rank's micro-batch: the gap is this rank's
                continue
            mask = b.target_mask.bool()
            recomputed.append(step.old[id(b)][mask])
            behaviour.append(b.behaviour_logprobs[mask].to(self.device))
            own = torch.tensor([version is None or step.seqs[r].generated_by(version) for r in b.rows], dtype=torch.bool)
            fresh.append(own[:, None].expand_as(mask)[mask])
        recomputed, behaviour, fresh = torch.cat(recomputed), torch.cat(behaviour), torch.cat(fresh)
        gaps = logprob_gap(recomputed, behaviour, fresh.long())
        gaps["logprob_gap_tokens"] = float(fresh.sum())
        if not fresh.all():
            gaps["logprob_abs_diff_stale"] = logprob_gap(recomputed, behaviour, (~fresh).long())["logprob_abs_diff"]
        return gaps

    def rl_step(self, sequences: Sequence[TrainSequence], trained_version: int | None = None) -> StepResult:
        """One policy update on a batch of complete groups: advantages, π_old and the off-policy correction, one
        optimizer step per minibatch, the step's metrics.

        `trained_version` is the version of the weights being trained: the logprob gap (invariant 3)
        is measured on the tokens it generated itself, where recompute and rollout must agree; tokens
        of older versions differ by design (staleness) and are reported apart. None: all tokens.
        """
        step = self._prepare(sequences)
        if isinstance(step, StepResult):
            return step
        if not step.reuse:
            with torch.no_grad():
                for b in step.micro:
                    step.anchor(b, self._logprobs(b).detach())
        step.count_trajectory_tokens()
        lr = self._lr()  # (the rate of the step's first optimizer step)
        step_metrics: list[dict[str, float]] = []
        grad_norms: list[float] = []
        skipped = 0
        for group in step.minibatches(self.config.minibatches):
            try:
                step_metrics += self.backend.optimise(group, functools.partial(self._loss_of, step, step.denominators(group)), LearnerError)
            except NonFiniteGradient as exc:
                raise RefusedUpdate(
                    f"{exc} (lower the learning rate or check the batch; the batch was not consumed)",
                    {**step.base, **self._logprob_gaps(step, trained_version), "grad_norm": exc.grad_norm, "refused_nonfinite_grad": 1.0},
                ) from None
            grad_norms.append(self.backend.last_grad_norm)
            skipped += self.backend.last_skipped
        self.steps_done += 1
        firsts = [s for s in sequences if s.chain == 0]
        metrics = {
            **step.base,
            **self._logprob_gaps(step, trained_version),
            **self._summarise(step_metrics),
            "grad_norm": max(grad_norms, default=0.0),
            **({"fp16_skipped_steps": float(skipped)} if self.config.dtype == "fp16" else {}),
            "advantage_mean": float(step.advantages.mean()),
            "advantage_std": float(step.advantages.std(correction=0)),
            "tokens_trained": float(sum(int(b.target_mask.sum()) for b in step.micro)),
            "sequences_trained": float(len(step.seqs)),
            "reward_mean": float(sum(s.reward for s in firsts) / len(firsts)),
            "reward_std": _mean_group_std(firsts),
            "lr": lr,
            "learner_ranks": float(self.backend.world()[0]),
            "learner_threads": float(torch.get_num_threads()),  # a replay computes with the same count
        }
        return StepResult(None, metrics, self._samples(sequences, step))

    def _prepare(self, sequences: Sequence[TrainSequence]) -> "_Step | StepResult":
        """The step's advantages (once per trajectory, however many chains it has) and its micro-batches; a
        StepResult where nothing is left to train."""
        if not sequences:
            raise LearnerError("empty batch: nothing to train on")
        index = trajectory_index(sequences)
        firsts = [i for i, s in enumerate(sequences) if s.chain == 0]
        adv = compute_advantages(
            [sequences[i].reward for i in firsts], [sequences[i].group_id for i in firsts], self.config.advantage
        ).per_sequence(index)
        keep = [i for i, s in enumerate(sequences) if adv.keep[i] and s.action_tokens > 0]
        base = {"degenerate_groups": float(adv.degenerate_groups), "groups": float(adv.groups)}
        if not keep:
            return StepResult("no sequence with action tokens and a usable group", base, self._samples(sequences, _Step.empty(adv)))
        seqs = [sequences[i] for i in keep]
        for s in seqs:
            if not np.isfinite(s.behaviour_logprobs).all():
                raise LearnerError(f"trajectory {s.trajectory_id} has NaN or inf rollout logprobs; refusing the step")
        loss = self.config.loss
        # With one optimizer step per learner step, π_old is π_θ before that step: the loss's own forward gives
        # it exactly (TRL does the same), saving a forward pass. A rejecting correction must know every
        # micro-batch's kept tokens before the first gradient (its denominators), so it keeps the pass.
        reuse = self.config.minibatches == 1 and not losses.CORRECTIONS[loss.correction].rejects
        return _Step(
            adv=adv, base=base, keep=keep, seqs=seqs, trajectory_of=[index[i] for i in keep], advantages=adv.values[keep].float(),
            micro=[pad(seqs, rows) for rows in micro_batches(seqs, self.config.micro_batch_tokens, self.config.share_prefix)], reuse=reuse, loss=loss, device=self.device,
        )

    def _loss_of(self, step: "_Step", denominators: tuple[float, float], batch: Padded) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's share of its minibatch's loss (`denominators`: the minibatch's tokens and trajectories
        in the loss), with the entropy at its action tokens."""
        reference = None
        if self.reference is not None:  # (before the policy's forward: see lora.adapters_off)
            with torch.no_grad():
                reference = self._logprobs(batch, self.reference)
        entropy: list[torch.Tensor] = []
        logp = self._logprobs(batch, entropy=entropy)
        if step.reuse:
            step.anchor(batch, logp.detach())
        tokens, trajectories = denominators
        out = policy_loss(
            logp, step.old[id(batch)], batch.behaviour_logprobs.to(self.device), step.advantages[batch.rows].to(self.device),
            batch.target_mask.to(self.device), step.loss, ref_logp=reference, total_tokens=max(tokens, 1.0),
            total_sequences=max(trajectories, 1.0), correction=step.corrections[id(batch)],
            sequence_tokens=torch.tensor([step.trajectory_tokens[step.trajectory_of[j]] for j in batch.rows], device=self.device),
        )
        if not torch.isfinite(out.loss):
            raise LearnerError("the loss is NaN or inf; refusing the update")
        actions = batch.target_mask.to(self.device).bool()
        return out.loss, {**out.metrics, "entropy": float(entropy[0][actions].mean()) if actions.any() else 0.0}

    @staticmethod
    def _samples(sequences: Sequence[TrainSequence], step: "_Step") -> dict[object, TrainedSample]:
        """Per trajectory: its advantage and group facts, what the correction did to its tokens, and π_old at them."""
        tokens: dict[int, dict] = {}
        for b in step.micro:
            c = step.corrections.get(id(b))
            if c is None:  # another rank's micro-batch (π_old came from the loss's forward on that rank)
                continue
            for row, j in enumerate(b.rows):
                kept, actions = c.kept[row].cpu(), b.target_mask[row].bool()
                recomputed = step.old[id(b)][row].cpu()[actions]
                gap = (recomputed - b.behaviour_logprobs[row][actions]).abs()
                tokens[j] = dict(
                    action_tokens=int(actions.sum()), rejected_tokens=int(actions.sum()) - int(kept.sum()),
                    correction_weight_mean=float(c.weight[row].cpu()[kept].mean()) if kept.any() else None,
                    learner_logprobs=tuple(recomputed.tolist()),
                    logprob_abs_diff_mean=float(gap.mean()) if gap.numel() else None,
                    logprob_abs_diff_max=float(gap.max()) if gap.numel() else None,
                )
        adv = step.adv
        position = {i: j for j, i in enumerate(step.keep)}  # index in `sequences` -> index in `seqs`
        out: dict[object, TrainedSample] = {}
        for i, s in enumerate(sequences):
            facts = tokens.get(position.get(i, -1), dict(action_tokens=s.action_tokens))
            sample = TrainedSample(
                float(adv.values[i]), float(adv.group_mean[i]), float(adv.group_std[i]), bool(adv.degenerate[i]), i in position, **facts
            )
            out[s.trajectory_id] = out[s.trajectory_id].then(sample) if s.chain else sample
        return out

    def sft_step(self, sequences: Sequence[TrainSequence]) -> StepResult:
        """Supervised step on the action tokens (the starter policy's warm start): mean -log p per token."""
        seqs = [s for s in sequences if s.action_tokens > 0]
        if not seqs:
            raise LearnerError("no action tokens in the batch: nothing to learn")
        micro = [pad(seqs, rows) for rows in micro_batches(seqs, self.config.micro_batch_tokens, self.config.share_prefix)]
        tokens = float(sum(int(b.target_mask.sum()) for b in micro))

        def loss_of(batch: Padded):
            logp = self._logprobs(batch)
            loss = aggregate(-logp, batch.target_mask.to(self.device), "token_mean", total_tokens=tokens)
            return loss, {"loss": float(loss.detach())}

        metrics = self.backend.optimise(micro, loss_of, LearnerError)
        self.steps_done += 1
        return StepResult(None, {"loss": sum(m["loss"] for m in metrics), "tokens_trained": tokens})

    # ------------------------------------------------------------------ state

    def save_checkpoint(self, directory: str | Path, policy_version: int, cursor: dict | None = None) -> Path:
        """Everything resume needs, written to a temporary directory and renamed into place when complete."""
        state = {"steps_done": self.steps_done, "policy_version": policy_version, "cursor": cursor or {}}
        learner = self.config.model_dump(mode="json")

        def fill(tmp: Path) -> None:
            self._save_state(tmp, state)
            checkpoint.save_rng(tmp)
            self.model.config.to_json_file(tmp / "model_config.json")
            checkpoint.mark_complete(tmp, {**state, "backend": self.backend_name, "learner": learner})

        # the trained weights and AdamW's two moments, in fp32 (DeepSpeed's ZeRO shards add up to about the same)
        return checkpoint.write_complete(directory, fill, need_bytes=3 * checkpoint.parameter_bytes(self.model, trained_only=True))

    def _save_state(self, directory: Path, state: dict) -> None:
        """The backend's part of a checkpoint (with several ranks, each writes its own shards here)."""
        self.backend.save(directory, state)

    def load_checkpoint(self, directory: str | Path) -> dict:
        path = Path(directory)
        marker = checkpoint.read_marker(path)
        if marker is None:
            raise LearnerError(f"{path} is not a complete loopline checkpoint (no {checkpoint.COMPLETE_MARKER}); it was not registered")
        mismatch = checkpoint.mismatched_model(path, self.model.config.to_dict())
        if mismatch:
            raise LearnerError(f"{path} holds a checkpoint of another model ({mismatch})")
        if (marker.get("learner") or {}).get("lora") != self.config.model_dump(mode="json")["lora"]:
            raise LearnerError(f"{path} was written by a learner with lora {marker['learner'].get('lora')}, this one has {self.config.lora}")
        if marker["backend"] != self.backend_name:
            raise LearnerError(f"{path} was written by the {marker['backend']} backend, this learner uses {self.backend_name}")
        state = self.backend.load(path)
        checkpoint.load_rng(path)
        self.steps_done = state["steps_done"]
        return state

    def export_weights(self, directory: str | Path) -> Path:
        """HF-format safetensors (plus the tokenizer) for the engines and evaluations of other processes;
        with LoRA, the merged model (a plain model directory)."""
        merged = lora.merged_state_dict(self.model) if self.config.lora is not None else None
        return checkpoint.export_weights(self.model, self.model_dir, directory, state_dict=merged)

    def export_adapter(self, directory: str | Path) -> Path:
        """A LoRA policy's adapter alone (peft format, a few % of the weights): what SGLang servers load per
        version instead of the merged model."""
        adapters = self.config.lora
        if adapters is None:
            raise LearnerError("export_adapter: this learner trains every weight (learner.lora is not set)")
        return checkpoint.write_complete(
            directory, lambda tmp: lora.save_adapter(self.model, adapters, tmp, str(self.model_dir)), need_bytes=checkpoint.parameter_bytes(self.model, trained_only=True)
        )

    def weights_sha256(self) -> str:
        if self.config.lora is not None:
            return checkpoint.tensors_sha256(lora.merged_parameters(self.model))
        return checkpoint.tensors_sha256(self.model.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights by the base model's names, as an in-process engine loads them (live tensors:
        copy before the next step); with LoRA, merged."""
        return lora.merged_state_dict(self.model) if self.config.lora is not None else self.model.state_dict()

    def parameters_vector(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in self.model.parameters()])
