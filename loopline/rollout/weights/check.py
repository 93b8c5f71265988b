"""Check a weights directory before a server loads it.

A real SGLang server that is told to load a truncated or wrong-shape safetensors file dies: its
updater points the model path at the new directory before loading, so the rollback reads the same
bad file again (docs/sglang-cpu/README.md). So every directory is checked here first, from the files'
headers only (no tensor is read): the config is there, every shard the index names exists, each
file is exactly as long as its header says, and the tensors' names, dtypes and shapes equal the
served model's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from loopline.errors import LooplineError


class BadWeights(LooplineError):
    """The directory would break a server that loads it: refused before the server is touched."""


Layout = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (dtype, shape)


def _read_header(file: Path) -> Layout:
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise BadWeights(f"{file}: shorter than a safetensors header")
            (length,) = struct.unpack("<Q", raw)
            if length > 100_000_000:
                raise BadWeights(f"{file}: header length {length} is not plausible (not a safetensors file?)")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise BadWeights(f"{file}: unreadable ({exc})") from None
    except (ValueError, UnicodeDecodeError):
        raise BadWeights(f"{file}: the safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise BadWeights(f"{file}: the safetensors header is not a JSON object")
    layout: Layout = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = info["data_offsets"]
            layout[name] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]))
        except (KeyError, TypeError, ValueError):
            raise BadWeights(f"{file}: tensor {name!r} has a malformed header entry") from None
        end = max(end, int(stop))
    size = file.stat().st_size
    if size != 8 + length + end:
        raise BadWeights(f"{file}: {size} bytes on disk, the header describes {8 + length + end} (a partial or corrupt write)")
    return layout


def read_layout(directory: str | Path) -> Layout:
    """Every tensor of a Hugging Face weights directory (one file, or shards with an index)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BadWeights(f"{directory}: not a directory")
    if not (directory / "config.json").is_file():
        raise BadWeights(f"{directory}: no config.json")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            raise BadWeights(f"{index}: not a valid safetensors index") from None
    else:
        shards = [p.name for p in sorted(directory.glob("*.safetensors"))]
    if not shards:
        raise BadWeights(f"{directory}: no safetensors files")
    layout: Layout = {}
    for shard in shards:
        if not (directory / shard).is_file():
            raise BadWeights(f"{directory}: shard {shard} named by the index is missing")
        layout.update(_read_header(directory / shard))
    return layout


def check_weights(directory: str | Path, served: Layout) -> None:
    """Raise BadWeights unless `directory` holds exactly the served model's tensors, complete on disk."""
    layout = read_layout(directory)
    missing = sorted(set(served) - set(layout))
    extra = sorted(set(layout) - set(served))
    changed = sorted(n for n in set(layout) & set(served) if layout[n] != served[n])
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors (e.g. {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} tensors the served model lacks (e.g. {extra[0]})")
    if changed:
        name = changed[0]
        problems.append(f"{len(changed)} tensors of another dtype or shape (e.g. {name}: {layout[name]} vs served {served[name]})")
    if problems:
        raise BadWeights(f"{directory} does not fit the served model: " + "; ".join(problems))


ADAPTER_PREFIX = "base_model.model."


def check_adapter(directory: str | Path, served: Layout) -> None:
    """Raise BadWeights unless `directory` is a complete peft LoRA adapter for the served model: its config is
    there, its safetensors file is exactly as long as its header says, and each layer's A [r, in] and B
    [out, r] fit the served weight [out, in] they adapt (an adapter of another model would be refused by the
    server only after it took its lock, or not at all)."""
    directory = Path(directory)
    if not (directory / "adapter_config.json").is_file():
        raise BadWeights(f"{directory}: no adapter_config.json (not a LoRA adapter directory)")
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
        rank = int(config["r"])
    except (OSError, ValueError, KeyError, TypeError):
        raise BadWeights(f"{directory / 'adapter_config.json'}: not a peft LoRA config with a rank `r`") from None
    layout = _read_header(directory / "adapter_model.safetensors") if (directory / "adapter_model.safetensors").is_file() else None
    if not layout:
        raise BadWeights(f"{directory}: no adapter_model.safetensors, or one without tensors")
    for name, (_, shape) in layout.items():
        base, dot, kind = name.removeprefix(ADAPTER_PREFIX).rpartition(".lora_")
        weight = served.get(f"{base}.weight")
        if not name.startswith(ADAPTER_PREFIX) or not dot or weight is None or len(shape) != 2:
            raise BadWeights(f"{directory}: tensor {name} adapts no weight of the served model")
        out_features, in_features = weight[1]
        expected = (rank, in_features) if kind.startswith("A") else (out_features, rank)
        if tuple(shape) != expected:
            raise BadWeights(f"{directory}: {name} has shape {tuple(shape)}, the served {base}.weight needs {expected} (rank {rank})")
