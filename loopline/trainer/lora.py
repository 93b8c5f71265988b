"""LoRA: low-rank adapters trained on a frozen base (peft), seen from outside as the merged model.

Only the adapters are trained, so only they are in the optimizer and in checkpoints; the base is the run's
initial weights, which every learner is built from anyway. Everything that leaves the learner - the sha256
a commit records, exports, the in-process engine's weights - is the merged model W + (alpha / r) B A under
the base model's own parameter names, so an engine, `loopline export` and a replay need not know that
adapters exist. The merge is computed beside the base weights, never into them (merging in place and back
out would change the base's last bits, and replays compare bits). The KL reference is the same model with
its adapters switched off: no second copy of the weights.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from loopline.errors import LooplineError
from loopline.trainer.config import LoraConfig

ADAPTER = "default"  # peft's name for a model's one adapter


def apply(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """Inject adapters into `model` in place (peft initialises B to zero: the merged model starts equal to the
    base) and freeze everything else."""
    import peft

    target = config.target_modules if isinstance(config.target_modules, str) else list(config.target_modules)
    peft_config = peft.LoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=target, bias="none"
    )
    try:
        return peft.inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER)
    except ValueError as exc:  # e.g. target modules that the model does not have
        raise ValueError(f"learner.lora: {exc}") from None


def check_targets(policy: Path, config: LoraConfig) -> None:
    """Refuse target modules the policy does not have, before any run exists: the model is built on the meta
    device (no weights read, no memory), and adapters are put on it as the learner would."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(policy))
    try:
        apply(model, config)
    except ValueError as exc:
        names = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)})
        raise LooplineError(f"{str(exc).splitlines()[0].rstrip('. ')}; the linear modules of {policy.name} are: {', '.join(names)}") from None


def _is_lora_layer(module: torch.nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each adapted layer's base weight's name -> its low-rank update (alpha / r) B A, detached."""
    with torch.no_grad():
        return {
            f"{name}.base_layer.weight": module.get_delta_weight(ADAPTER).detach()
            for name, module in model.named_modules()
            if _is_lora_layer(module)
        }


def _merged(items: Iterator[tuple[str, torch.Tensor]], deltas: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in items:
        if ".lora_" in name:  # lora_A / lora_B (and peft's other adapter tensors)
            continue
        tensor = tensor.detach()
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        yield name.replace(".base_layer.", "."), tensor


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict (its keys, tied weights and buffers included) with the adapters merged."""
    return dict(_merged(iter(model.state_dict().items()), _deltas(model)))


def merged_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_parameters()` of the merged model, in the base model's order (what `tensors_sha256` hashes)."""
    return _merged(model.named_parameters(), _deltas(model))


def save_adapter(model: torch.nn.Module, config: LoraConfig, directory: Path, base: str) -> None:
    """The adapter alone, as `PeftModel.save_pretrained` writes it (`adapter_config.json`,
    `adapter_model.safetensors` with `base_model.model.` names): what an SGLang server loads with
    `/load_lora_adapter` and peft with `PeftModel.from_pretrained(base, directory)`. Its target modules are
    the layers' short names (q_proj, ...), as SGLang reads them."""
    import peft
    from safetensors.torch import save_file

    tensors = peft.get_peft_model_state_dict(model, adapter_name=ADAPTER)
    save_file({f"base_model.model.{name}": t.detach().contiguous() for name, t in tensors.items()}, directory / "adapter_model.safetensors")
    targets = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _is_lora_layer(m)})
    peft.LoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=targets, bias="none",
        base_model_name_or_path=base, task_type="CAUSAL_LM",
    ).save_pretrained(directory)


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """The base model, for the KL reference: every adapter bypassed while the block runs. (peft's switch also
    freezes the adapters and unfreezes them after: call it before the policy's own forward of a micro-batch,
    never between that forward and its backward.)"""
    layers = [m for m in model.modules() if _is_lora_layer(m)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class BaseOf:
    """The frozen base under a LoRA policy, read as the learner reads a model (`forward`, `call`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.call(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=0 if keep is None else keep, use_cache=False).logits

    def call(self, **kwargs):
        with adapters_off(self.model), torch.no_grad():
            return self.model(**kwargs)
