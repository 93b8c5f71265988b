"""The learner: one policy update per call, on DeepSpeed (or a plain torch loop, for comparison).

A step recomputes π_old for the whole batch first (no grad; it is also the
"learner-recomputed" logprobs compared with the rollout's μ), then takes
`minibatches` optimizer steps over token-budgeted micro-batches with
gradient accumulation. Every micro-batch's loss is its exact share of the
step's loss (see `aggregate`), so micro-batching changes nothing but memory.

On CPU DeepSpeed runs fp32 with gloo (`DS_ACCELERATOR=cpu`); one process
needs no launcher, and the `deepspeed` launcher runs several.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import torch
import torch.nn.functional as F

from loopline.failpoints import failpoint
from loopline.holder import process_alive

from loopline.trainer.advantages import AdvantageConfig, compute_advantages
from loopline.trainer.batch import Padded, TrainSequence, micro_batches, pad
from loopline.trainer.losses import LossConfig, aggregate, logprob_gap, policy_loss

Backend = Literal["deepspeed", "torch"]
COMPLETE_MARKER = "loopline_checkpoint.json"


class LearnerError(ValueError):
    """The step or checkpoint is refused (bad batch, NaN, mismatched checkpoint); nothing was updated."""


@dataclass(frozen=True)
class LearnerConfig:
    lr: float = 1e-5
    warmup_steps: int = 0  # linear warm-up of the learning rate over this many optimizer steps
    decay_steps: int | None = None  # cosine decay to 10% of lr by this step (None: constant after warm-up)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0  # must equal the rollout's: logprobs are log_softmax(logits / T)
    micro_batch_tokens: int = 8192
    minibatches: int = 1  # optimizer steps per learner step (π_old anchors all of them)
    zero_stage: int = 1
    dtype: Literal["fp32", "bf16"] = "fp32"
    seed: int = 0
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)


@dataclass(frozen=True)
class StepResult:
    skipped: str | None  # why the step did nothing, or None
    metrics: dict[str, float]


def _init_distributed(backend: str) -> None:
    """Join the launcher's process group, or form a one-process one.

    Without a launcher the group rendezvouses through a file, not a TCP port: a port chosen in
    advance can be taken by any outgoing connection before DeepSpeed binds it (it happened in CI),
    and two learners on one machine would collide on a fixed one.
    """
    import deepspeed

    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))
    if not torch.distributed.is_initialized() and not launched:  # (a stray RANK alone, e.g. inherited, is no launcher)
        for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            os.environ[key] = value
        rendezvous = Path(tempfile.mkdtemp(prefix="loopline-dist-"))
        atexit.register(shutil.rmtree, rendezvous, ignore_errors=True)
        torch.distributed.init_process_group(backend, init_method=f"file://{rendezvous / 'store'}", rank=0, world_size=1)
    if not torch.cuda.is_available():
        # DeepSpeed's CPU backend would JIT-compile its shared-memory all-reduce (`deepspeed_shm_comm`, ~2 min
        # of c++ at the first run on a machine) behind a lock file that a killed build leaves behind, after
        # which every later start waits on it forever. gloo does the all-reduce instead: one process needs
        # none, and several ranks on one host lose only a faster reduction. DeepSpeed consults this table
        # before building the op.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    failpoint("deepspeed_start")
    deepspeed.init_distributed(backend)


def _partial_name(target: Path) -> Path:
    """Checkpoints and exports are written beside their target under this name, then renamed into place."""
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


def clean_partial_writes(root: Path) -> list[Path]:
    """Remove half-written checkpoints and exports under `root` whose writer process is gone."""
    removed = []
    for path in root.glob("*/.*.tmp-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _bf16_supported() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


class Learner:
    def __init__(self, model_dir: str | Path, config: LearnerConfig = LearnerConfig(), backend: Backend = "deepspeed"):
        from transformers import AutoModelForCausalLM

        if config.dtype == "bf16" and not _bf16_supported():
            raise LearnerError("bf16 was asked for, but this machine has no bf16-capable GPU; use dtype fp32")
        self.config, self.backend, self.model_dir = config, backend, Path(model_dir)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        if backend == "deepspeed":
            import deepspeed

            _init_distributed("nccl" if torch.cuda.is_available() else "gloo")
            ds_config = {
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
                "gradient_clipping": config.grad_clip,
                "zero_optimization": {"stage": config.zero_stage},
                "bf16": {"enabled": config.dtype == "bf16"},
                "steps_per_print": 10**9,
                "wall_clock_breakdown": False,
            }
            self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
            )
            self.model = self.engine.module
        else:
            self.engine, self.optimizer, self.model = None, optimizer, model.to(self.device)
            self.scheduler = scheduler
        self.steps_done = 0
        self._broken: str | None = None

    def _lr_factor(self, step: int) -> float:
        c = self.config
        if c.warmup_steps and step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.decay_steps:
            progress = min(1.0, (step - c.warmup_steps) / max(1, c.decay_steps - c.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    # ------------------------------------------------------------------ forward

    def _logprobs(self, batch: Padded) -> torch.Tensor:
        model = self.engine if self.engine is not None else self.model
        logits = model(input_ids=batch.input_ids.to(self.device), attention_mask=batch.attention_mask.to(self.device)).logits
        logits = logits[:, :-1].float() / self.config.temperature
        targets = batch.input_ids[:, 1:].to(self.device)
        return F.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]

    def _world(self) -> tuple[int, int]:
        if self.engine is None or not torch.distributed.is_initialized():
            return 1, 0
        return torch.distributed.get_world_size(), torch.distributed.get_rank()

    def _optimise(self, micro: list[Padded], loss_of) -> list[dict[str, float]]:
        """One optimizer step over the step's micro-batches (the same list on every rank).

        Rank r trains micro-batches r, r + world, ...; every rank runs the same number of
        accumulation steps (an empty one where it has none left), and because each loss is its
        share of the whole step's loss, the averaged gradient equals one process's on the full batch.
        `loss_of(batch)` returns (share of the loss, metrics).
        """
        metrics = []
        if self._broken:
            raise LearnerError(f"an earlier step was refused halfway ({self._broken}); restore the last checkpoint")
        if self.engine is not None:
            world, rank = self._world()
            mine = micro[rank::world]
            count = math.ceil(len(micro) / world)
            self.engine.set_train_batch_size(count * world)  # gradient accumulation over exactly `count` micro-batches
            for i in range(count):
                if i < len(mine):
                    try:
                        loss, m = loss_of(mine[i])
                    except LearnerError as exc:
                        # DeepSpeed already holds this step's earlier gradients: this learner must not step again
                        self._broken = str(exc)
                        raise
                    metrics.append(m)
                else:  # a real forward through the engine, weighted 0: this rank has no micro-batch left
                    loss = loss_of(micro[0])[0] * 0.0
                self.engine.backward(loss * count * world)  # DeepSpeed divides by accumulation steps and ranks
                self.engine.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            for batch in micro:
                loss, m = loss_of(batch)
                loss.backward()
                metrics.append(m)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
        return metrics

    def _summarise(self, step_metrics: list[dict[str, float]]) -> dict[str, float]:
        """Loss and token-weighted statistics over every rank's micro-batches."""
        sums = torch.tensor(
            [
                sum(m["loss"] for m in step_metrics),
                sum(m["tokens"] for m in step_metrics),
                sum(m["ratio_mean"] * m["tokens"] for m in step_metrics),
                sum(m["clip_fraction"] * m["tokens"] for m in step_metrics),
                sum(m["correction_capped_fraction"] * m["tokens"] for m in step_metrics),
                sum(m["kl_ref"] * m["tokens"] for m in step_metrics),
            ],
            dtype=torch.float64,
        )
        ratio_max = torch.tensor([max((m["ratio_max"] for m in step_metrics), default=1.0)], dtype=torch.float64)
        if self._world()[0] > 1:
            torch.distributed.all_reduce(sums)
            torch.distributed.all_reduce(ratio_max, op=torch.distributed.ReduceOp.MAX)
        loss, tokens, ratio, clip, capped, kl = sums.tolist()
        n = max(tokens, 1.0)
        return {
            "loss": loss,
            "kl_ref": kl / n,
            "ratio_mean": ratio / n,
            "ratio_max": float(ratio_max),
            "clip_fraction": clip / n,
            "correction_capped_fraction": capped / n,
        }

    # ------------------------------------------------------------------ steps

    def _logprob_gaps(self, micro: list[Padded], old: dict, seqs: Sequence[TrainSequence], version: int | None) -> dict:
        recomputed, behaviour, fresh = [], [], []
        for b in micro:
            mask = b.target_mask.bool()
            recomputed.append(old[id(b)][mask])
            behaviour.append(b.behaviour_logprobs[mask].to(self.device))
            own = torch.tensor([version is None or seqs[r].generated_by(version) for r in b.rows], dtype=torch.bool)
            fresh.append(own[:, None].expand_as(mask)[mask])
        recomputed, behaviour, fresh = torch.cat(recomputed), torch.cat(behaviour), torch.cat(fresh)
        gaps = logprob_gap(recomputed, behaviour, fresh.long())
        gaps["logprob_gap_tokens"] = float(fresh.sum())
        if not fresh.all():
            gaps["logprob_abs_diff_stale"] = logprob_gap(recomputed, behaviour, (~fresh).long())["logprob_abs_diff"]
        return gaps

    def rl_step(self, sequences: Sequence[TrainSequence], trained_version: int | None = None) -> StepResult:
        """One policy update on a batch of complete groups.

        `trained_version` is the version of the weights being trained: the logprob gap (invariant 3)
        is measured on the tokens it generated itself, where recompute and rollout must agree; tokens
        of older versions differ by design (staleness) and are reported apart. None: all tokens.
        """
        if not sequences:
            raise LearnerError("empty batch: nothing to train on")
        adv = compute_advantages([s.reward for s in sequences], [s.group_id for s in sequences], self.config.advantage)
        keep = [i for i, s in enumerate(sequences) if adv.keep[i] and s.action_tokens > 0]
        base = {"degenerate_groups": float(adv.degenerate_groups), "groups": float(adv.groups)}
        if not keep:
            return StepResult("no sequence with action tokens and a usable group", base)
        seqs = [sequences[i] for i in keep]
        advantages = adv.values[keep].float()
        for s in seqs:
            if not all(math.isfinite(x) for x in s.behaviour_logprobs):
                raise LearnerError(f"trajectory {s.trajectory_id} has NaN or inf rollout logprobs; refusing the step")
        micro = [pad(seqs, rows) for rows in micro_batches(seqs, self.config.micro_batch_tokens)]
        with torch.no_grad():
            old = {id(b): self._logprobs(b).detach() for b in micro}  # π_old for every micro-batch
        if not all(torch.isfinite(old[id(b)][b.target_mask.bool()]).all() for b in micro):
            raise LearnerError("the policy's own logprobs are NaN or inf on action tokens; refusing the update")
        gap = self._logprob_gaps(micro, old, seqs, trained_version)
        groups = [micro[i :: self.config.minibatches] for i in range(self.config.minibatches)]
        step_metrics: list[dict[str, float]] = []
        for group in (g for g in groups if g):
            tokens = float(sum(int(b.target_mask.sum()) for b in group))
            seq_count = float(sum(int((b.target_mask.sum(-1) > 0).sum()) for b in group))

            def loss_of(batch: Padded):
                logp = self._logprobs(batch)
                out = policy_loss(
                    logp, old[id(batch)], batch.behaviour_logprobs.to(self.device), advantages[batch.rows].to(self.device),
                    batch.target_mask.to(self.device), self.config.loss, total_tokens=tokens, total_sequences=seq_count,
                )
                if not torch.isfinite(out.loss):
                    raise LearnerError("the loss is NaN or inf; refusing the update")
                return out.loss, out.metrics

            step_metrics += self._optimise(group, loss_of)
        self.steps_done += 1
        metrics = {
            **base,
            **gap,
            **self._summarise(step_metrics),
            "advantage_mean": float(advantages.mean()),
            "advantage_std": float(advantages.std(correction=0)),
            "tokens_trained": float(sum(int(b.target_mask.sum()) for b in micro)),
            "sequences_trained": float(len(seqs)),
            "reward_mean": float(sum(s.reward for s in sequences) / len(sequences)),
        }
        return StepResult(None, metrics)

    def sft_step(self, sequences: Sequence[TrainSequence]) -> StepResult:
        """Supervised step on the action tokens (the starter policy's warm start): mean -log p per token."""
        seqs = [s for s in sequences if s.action_tokens > 0]
        if not seqs:
            raise LearnerError("no action tokens in the batch: nothing to learn")
        micro = [pad(seqs, rows) for rows in micro_batches(seqs, self.config.micro_batch_tokens)]
        tokens = float(sum(int(b.target_mask.sum()) for b in micro))

        def loss_of(batch: Padded):
            logp = self._logprobs(batch)
            loss = aggregate(-logp, batch.target_mask.to(self.device), "token_mean", total_tokens=tokens)
            return loss, {"loss": float(loss.detach())}

        metrics = self._optimise(micro, loss_of)
        self.steps_done += 1
        return StepResult(None, {"loss": sum(m["loss"] for m in metrics), "tokens_trained": tokens})

    # ------------------------------------------------------------------ state

    def save_checkpoint(self, directory: str | Path, policy_version: int, cursor: dict | None = None) -> Path:
        """Everything resume needs, written to a temporary directory and renamed into place when complete."""
        target = Path(directory)
        tmp = _partial_name(target)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        state = {"steps_done": self.steps_done, "policy_version": policy_version, "cursor": cursor or {}}
        if self.engine is not None:
            self.engine.save_checkpoint(str(tmp), tag="state", client_state={"loopline": state})
        else:
            torch.save(
                {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "loopline": state},
                tmp / "state.pt",
            )
        torch.save(rng, tmp / "rng.pt")
        self.model.config.to_json_file(tmp / "model_config.json")
        marker = {**state, "backend": self.backend, "learner": asdict(self.config) | {"advantage": asdict(self.config.advantage), "loss": asdict(self.config.loss)}}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, default=str))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        return target

    def load_checkpoint(self, directory: str | Path) -> dict:
        path = Path(directory)
        if not (path / COMPLETE_MARKER).is_file():
            raise LearnerError(f"{path} is not a complete loopline checkpoint (no {COMPLETE_MARKER}); it was not registered")
        saved = json.loads((path / "model_config.json").read_text())
        current = self.model.config.to_dict()
        for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if saved.get(key) != current.get(key):
                raise LearnerError(f"{path} holds a checkpoint of another model ({key}: {saved.get(key)} vs {current.get(key)})")
        marker = json.loads((path / COMPLETE_MARKER).read_text())
        if marker["backend"] != self.backend:
            raise LearnerError(f"{path} was written by the {marker['backend']} backend, this learner uses {self.backend}")
        if self.engine is not None:
            _, client = self.engine.load_checkpoint(str(path), tag="state")
            state = client["loopline"]
        else:
            blob = torch.load(path / "state.pt", weights_only=False)
            self.model.load_state_dict(blob["model"])
            self.optimizer.load_state_dict(blob["optimizer"])
            self.scheduler.load_state_dict(blob["scheduler"])
            state = blob["loopline"]
        rng = torch.load(path / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        self.steps_done = state["steps_done"]
        return state

    def export_weights(self, directory: str | Path) -> str:
        """HF-format safetensors (plus the tokenizer) for the engines; returns the sha256 of the weights."""
        target = Path(directory)
        tmp = _partial_name(target)
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        for name in os.listdir(self.model_dir):
            if name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config", "loopline_prompt")) and not (tmp / name).exists():
                shutil.copy(self.model_dir / name, tmp / name)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        return weights_sha256(target)

    def parameters_vector(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in self.model.parameters()])


def weights_sha256(directory: str | Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()
