"""Checkpoints and weight exports on disk: written beside their target and renamed into place when complete,
so a reader never sees half a directory, and the half-written ones of dead writers can be found and removed."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from loopline.errors import LooplineError
from loopline.holder import process_alive

COMPLETE_MARKER = "loopline_checkpoint.json"
_TOKENIZER_FILES = ("tokenizer", "special_tokens", "chat_template", "generation_config", "loopline_prompt")


def partial_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


class DiskFull(LooplineError):
    """A checkpoint or an export that does not fit on its disk. Nothing is committed for that step, so the run
    resumes from the ledger once there is room."""

    @classmethod
    def of(cls, target: Path, need: int, free: int) -> "DiskFull":
        return cls(
            f"no space left on the disk of {target.parent} for {target.name.split('.')[0]}: it needs about {_size(need)}, "
            f"{_size(free)} are free there; free some (or set LOOPLINE_HOME to a larger disk) and resume the run "
            "(loopline train --resume RUN)"
        )


# Below this much room a failed write is taken for a full disk: torch.save reports ENOSPC as a RuntimeError
# ("unexpected pos ..."), and root writes into the blocks reserved for it past what statvfs calls available.
_FULL_BELOW = 16 * 2**20


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _free(path: Path) -> int:
    return shutil.disk_usage(path).free


def _out_of_space(exc: BaseException, where: Path) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left" in str(exc) or _free(where) < _FULL_BELOW


def parameter_bytes(model, trained_only: bool = False) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trained_only)


def write_complete(target: str | Path, fill: Callable[[Path], None], need_bytes: int = 0) -> Path:
    """Let `fill` write a fresh directory beside `target`, then move it into place in one rename. `need_bytes`
    (an estimate of what `fill` writes) is checked against the free space first, so that a full disk is one
    line naming the place and the size rather than a library's error half-way through a file."""
    target = Path(target)
    tmp = partial_name(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if need_bytes > (free := _free(tmp.parent)):
        raise DiskFull.of(target, need_bytes, free)
    try:
        tmp.mkdir()
        fill(tmp)
    except Exception as exc:
        full = _out_of_space(exc, tmp.parent)
        free = _free(tmp.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFull.of(target, max(need_bytes, free + 1), free) from exc
        raise
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def clean_partial_writes(root: Path) -> list[Path]:
    """Remove half-written checkpoints and exports under `root` whose writer process is gone."""
    removed = []
    for path in root.glob("*/.*.tmp-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def clean_unnamed_writes(root: Path, named: set[str], own: bool = False) -> list[Path]:
    """Remove a learner's own checkpoint and export directories (`NAME.PID`, see pipeline/stages.learn) that no
    ledger row names and whose writer is gone: what a learner that lost the run, or died between writing
    and committing, left behind. `own`: this process's too (it is on its way out: a stop signal, a lost
    run or a failure aborted a step between its writes and its commit; with a real model, gigabytes)."""
    kept = {Path(uri).name for uri in named}  # by name: the same directory may be reached by another path
    removed = []
    for path in root.glob("*/*.*"):
        pid = path.name.rsplit(".", 1)[1]
        gone = pid.isdigit() and ((own and int(pid) == os.getpid()) or not process_alive(int(pid)))
        if path.is_dir() and gone and path.name not in kept:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def save_rng(directory: Path) -> None:
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, directory / "rng.pt")


def load_rng(directory: Path) -> None:
    rng = torch.load(directory / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])


def mark_complete(directory: Path, marker: dict[str, Any]) -> None:
    (directory / COMPLETE_MARKER).write_text(json.dumps(marker, default=str))


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The checkpoint's marker, or None when the directory is not a complete loopline checkpoint."""
    path = directory / COMPLETE_MARKER
    return json.loads(path.read_text()) if path.is_file() else None


def mismatched_model(directory: Path, current: dict[str, Any]) -> str | None:
    """Why a checkpoint does not fit the model loaded now (its config differs where shapes depend on it)."""
    saved = json.loads((directory / "model_config.json").read_text())
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if saved.get(key) != current.get(key):
            return f"{key}: {saved.get(key)} vs {current.get(key)}"
    return None


def export_weights(model, model_dir: Path, target: str | Path, state_dict: dict | None = None) -> Path:
    """HF-format safetensors plus the policy's tokenizer files, for the engines; `state_dict` (the model's
    keys) instead of the model's own tensors, e.g. LoRA merged."""

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        for name in os.listdir(model_dir):
            if name.startswith(_TOKENIZER_FILES) and not (tmp / name).exists():
                shutil.copy(model_dir / name, tmp / name)

    return write_complete(target, fill, need_bytes=parameter_bytes(model))


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A policy version's identity: sha256 over a model's `named_parameters()` (name, dtype, shape, bytes),
    in their order. Computed in memory (~0.3 s for 135M fp32), so a version has one whether it was exported
    or not, and a replay or a later export can be compared with it."""
    digest = hashlib.sha256()
    for name, param in named:
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor  # numpy has no bfloat16
        digest.update(memoryview(raw.numpy()).cast("B"))
    return digest.hexdigest()


def weights_sha256(directory: str | Path) -> str:
    """`tensors_sha256` of an export on disk (loaded as the engines load it)."""
    from transformers import AutoModelForCausalLM

    return tensors_sha256(AutoModelForCausalLM.from_pretrained(directory, dtype="auto").named_parameters())
