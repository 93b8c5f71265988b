"""How a learner applies its updates: DeepSpeed (ZeRO, several ranks) or a plain torch loop, behind one interface.

`Learner` computes losses; a backend owns the model wrapper, the optimizer and the schedule, runs the
optimizer step over a step's micro-batches, and saves and restores that state. On CPU DeepSpeed runs
fp32 with gloo (`DS_ACCELERATOR=cpu`); one process needs no launcher, and the `deepspeed` launcher
runs several.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from loopline.failpoints import failpoint
from loopline.trainer.batch import Padded
from loopline.trainer.config import BACKENDS, Backend, BackendName, LossFn  # noqa: F401 (re-exported)



class NonFiniteGradient(Exception):
    """The step's gradient norm is NaN or inf: the optimizer step is refused (nothing trained)."""

    def __init__(self, grad_norm: float):
        super().__init__(f"the gradient norm is {grad_norm}: the update is refused")
        self.grad_norm = grad_norm


def _keep(positions: torch.Tensor | None):
    """transformers' `logits_to_keep`: 0 keeps every position, a tensor keeps those positions."""
    return 0 if positions is None else positions


def _frozen(model) -> set[str]:
    """Names of the weights no optimizer trains (LoRA's base): a checkpoint leaves them out, since every
    learner is built from the run's initial weights first."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _load_trained(model, state: dict) -> None:
    frozen = _frozen(model)
    missing, unexpected = model.load_state_dict(state, strict=not frozen)
    if unexpected or set(missing) - frozen:
        raise ValueError(f"the checkpoint does not hold this model's trained weights (missing {sorted(set(missing) - frozen)[:3]}, unexpected {unexpected[:3]})")


def _grad_norm(parameters) -> float:
    grads = [p.grad for p in parameters if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def init_distributed(backend: str) -> None:
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
    # On an H200 a finished `loopline train` never exited while its NCCL group was left to the interpreter's
    # teardown (torch 2.11); taken down at exit (before the rendezvous is removed: atexit runs last-in first-out),
    # it exits. Every rank does it, launched or not.
    atexit.unregister(_destroy_process_group)  # (once, however many learners this process builds)
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()




class DeepSpeedBackend:
    """fp16 (`dtype: fp16`, GPUs without bf16) is DeepSpeed's dynamic loss scaling: a step whose scaled
    gradients overflow is skipped and the scale lowered, as DeepSpeed, TRL and verl do; overflow there is
    the scale's business, not a refused update, so the non-finite-gradient refusal does not apply and the
    skip is counted instead (`last_skipped`). It runs under ZeRO (stage 1 on one rank as well): ZeRO
    reports the unscaled gradient norm (stage 0's fp16 optimizer reports the scaled one), and the loss
    scaler keeps fp32 master weights either way, so ZeRO-1 costs nothing more."""

    def __init__(self, model, optimizer, scheduler, grad_clip: float, zero_stage: int | None, dtype: str):
        import deepspeed

        init_distributed("nccl" if torch.cuda.is_available() else "gloo")
        if zero_stage is None:  # one rank: ZeRO's flat fp32 copy and gradient buffers (+1.5 GB at 135M) partition nothing
            zero_stage = 0 if torch.distributed.get_world_size() == 1 and dtype != "fp16" else 1
        if zero_stage == 0 and dtype == "fp16":
            raise ValueError("dtype fp16 runs under ZeRO (zero_stage 1 or more), whose gradient norm is the unscaled one")
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": grad_clip,
            "zero_optimization": {"stage": zero_stage},
            "bf16": {"enabled": dtype == "bf16"},
            "fp16": {"enabled": dtype == "fp16"},  # (loss_scale 0: dynamic, from 2**16)
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        self.model = self.engine.module
        self.zero_stage = zero_stage
        self.loss_scaled = dtype == "fp16"
        self._broken: str | None = None
        self.last_grad_norm = 0.0
        self.last_skipped = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.engine(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=_keep(keep), use_cache=False).logits

    def call(self, **kwargs) -> Any:
        return self.engine(**kwargs)

    def world(self) -> tuple[int, int]:
        if not torch.distributed.is_initialized():
            return 1, 0
        return torch.distributed.get_world_size(), torch.distributed.get_rank()

    def optimise(self, micro: list[Padded], loss_of: LossFn, on_error: type[Exception]) -> list[dict[str, float]]:
        """Rank r trains micro-batches r, r + world, ...; every rank runs the same number of
        accumulation steps (an empty one where it has none left), and because each loss is its
        share of the whole step's loss, the averaged gradient equals one process's on the full batch."""
        if self._broken:
            raise on_error(f"an earlier step was refused halfway ({self._broken}); restore the last checkpoint")
        metrics = []
        world, rank = self.world()
        mine = micro[rank::world]
        count = math.ceil(len(micro) / world)
        self.engine.set_train_batch_size(count * world)  # the loss is divided by `count` accumulation steps
        for i in range(count):
            # DeepSpeed's own boundary is every `count`-th micro-step counted over the whole run: once the count
            # changes from one step to the next it would update mid-step and carry the rest into the next one
            self.engine.set_gradient_accumulation_boundary(i == count - 1)
            if i < len(mine):
                try:
                    loss, m = loss_of(mine[i])
                except on_error as exc:
                    # DeepSpeed already holds this step's earlier gradients: this learner must not step again
                    self._broken = str(exc)
                    raise
                metrics.append(m)
            else:  # a real forward through the engine, weighted 0: this rank has no micro-batch left
                loss = loss_of(micro[0])[0] * 0.0
            self.engine.backward(loss * count * world)  # DeepSpeed divides by accumulation steps and ranks
            if i == count - 1 and self.zero_stage == 0:
                # without ZeRO the reduced gradients are whole in param.grad at the boundary: a non-finite
                # norm is refused before the optimizer sees it
                self.last_grad_norm = _grad_norm(self.model.parameters())
                if not math.isfinite(self.last_grad_norm):
                    self._broken = f"gradient norm {self.last_grad_norm}"
                    raise NonFiniteGradient(self.last_grad_norm)
            self.engine.step()
        self.last_skipped = self.loss_scaled and not self.engine.was_step_applied()
        if self.last_skipped:  # the scale is lowered and the next step tries again; nothing was applied
            self.last_grad_norm = 0.0
        elif self.zero_stage >= 1:  # ZeRO moves gradients into its own buffers: its norm is known only after its step
            self.last_grad_norm = float(self.engine.get_global_grad_norm() or 0.0)
            if not math.isfinite(self.last_grad_norm):
                self._broken = f"gradient norm {self.last_grad_norm}"
                raise NonFiniteGradient(self.last_grad_norm)
        return metrics

    def save(self, directory: Path, client_state: dict[str, Any]) -> None:
        self.engine.save_checkpoint(
            str(directory), tag="state", client_state={"loopline": client_state}, exclude_frozen_parameters=bool(_frozen(self.model))
        )

    def load(self, directory: Path) -> dict[str, Any]:
        frozen = _frozen(self.model)
        _, client = self.engine.load_checkpoint(str(directory), tag="state", load_module_strict=not frozen)
        return client["loopline"]


class Frozen:
    """A model that is only read, as the learner reads its policy (`forward`, `call`): the KL reference."""

    def __init__(self, model, device: torch.device):
        self.model = model.to(device).eval().requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=_keep(keep), use_cache=False).logits

    def call(self, **kwargs) -> Any:
        return self.model(**kwargs)


class TorchBackend(Frozen):
    """The plain torch loop: the model read as `Frozen` reads it, trained by its optimizer."""

    def __init__(self, model, optimizer, scheduler, grad_clip: float, device: torch.device):
        self.model, self.optimizer, self.scheduler = model.to(device), optimizer, scheduler
        self.grad_clip = grad_clip
        self.last_grad_norm = 0.0
        self.last_skipped = False  # (fp32 only: no loss scale to skip steps)

    def world(self) -> tuple[int, int]:
        return 1, 0

    def optimise(self, micro: list[Padded], loss_of: LossFn, on_error: type[Exception]) -> list[dict[str, float]]:
        metrics = []
        self.optimizer.zero_grad(set_to_none=True)
        for batch in micro:
            loss, m = loss_of(batch)
            loss.backward()
            metrics.append(m)
        self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        if not math.isfinite(self.last_grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteGradient(self.last_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        return metrics

    def save(self, directory: Path, client_state: dict[str, Any]) -> None:
        frozen = _frozen(self.model)
        model = {k: v for k, v in self.model.state_dict().items() if k not in frozen}
        state = {"model": model, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        torch.save({**state, "loopline": client_state}, directory / "state.pt")

    def load(self, directory: Path) -> dict[str, Any]:
        blob = torch.load(directory / "state.pt", weights_only=False)
        _load_trained(self.model, blob["model"])
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
        return blob["loopline"]


def _deepspeed(model, optimizer, scheduler, config, device: torch.device) -> Backend:
    return DeepSpeedBackend(model, optimizer, scheduler, config.grad_clip, config.zero_stage, config.dtype)


def _torch(model, optimizer, scheduler, config, device: torch.device) -> Backend:
    if config.dtype != "fp32":
        raise ValueError(f"dtype {config.dtype} needs backend deepspeed (the torch backend trains in fp32)")
    return TorchBackend(model, optimizer, scheduler, config.grad_clip, device)


# `learner.backend` by name: a backend is its Backend and its registration, `@BACKENDS.register("name")` on a
# `config.BuildBackend`, in whatever module defines it.
BACKENDS.register("deepspeed")(_deepspeed)
BACKENDS.register("torch")(_torch)
BACKENDS.check_implemented()


def build_backend(name: BackendName, model, optimizer, scheduler, config, device: torch.device) -> Backend:
    """The backend a run config names (`learner.backend`)."""
    BACKENDS.check(name)
    return BACKENDS[name](model, optimizer, scheduler, config, device)
