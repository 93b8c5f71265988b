"""Where a run's starting policy is found, without torch: the shipped tiny starters, the loopline home's
models, a model directory, or the Hugging Face cache. (Building or converting one is `starter`'s work.)"""

from __future__ import annotations

import re
from pathlib import Path

from loopline.errors import LooplineError
from loopline.plan import ModelShape

# Starters shipped in the package (built by `loopline models build-tiny`, ~1.4 MB each): the quickstart's
# environment with seed 0 needs no build. An edited environment or another seed is built on first use.
SHIPPED_STARTERS = Path(__file__).resolve().parent.parent / "starters"

HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")
# what a causal LM needs to load and serve (weights as safetensors); not pytorch_model.bin, GGUF or ONNX copies
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def tiny_policy_name(spec_hash: str, seed: int) -> str:
    """One tiny policy per (environment content, seed): it is built from that environment's tasks."""
    return f"tiny-{spec_hash[:12]}-s{seed}"


def tiny_policy_dir(spec_hash: str, seed: int) -> Path:
    from loopline.store.db import loopline_home

    return loopline_home() / "models" / tiny_policy_name(spec_hash, seed)


def hub_policy(repo_id: str, files: list[str] = HUB_FILES) -> Path:
    """A model given by its Hub id: the local Hugging Face cache's copy (HF_HOME, HF_HUB_CACHE), else downloaded
    into that cache, where the next run finds it offline. `files`: the patterns needed (a plan needs config.json)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE, HF_HUB_OFFLINE

    def missing(why: str) -> LooplineError:
        return LooplineError(
            f"policy {repo_id!r}: not in the Hugging Face cache ({HF_HUB_CACHE}) and {why}; download it where the Hub is "
            f"reachable (hf download {repo_id}) and copy the cache here, or give a model directory"
        )

    try:
        return Path(snapshot_download(repo_id, allow_patterns=files, local_files_only=True))
    except Exception as cached_exc:  # not in the cache (or only partly): the Hub, unless told to stay offline
        if HF_HUB_OFFLINE:
            raise missing("HF_HUB_OFFLINE is set") from cached_exc
    try:
        return Path(snapshot_download(repo_id, allow_patterns=files))
    except Exception as exc:
        raise missing(f"the Hub could not give it ({(str(exc).strip().splitlines() or [type(exc).__name__])[0]})") from None


def unknown_policy(policy: str) -> LooplineError:
    return LooplineError(
        f"policy {policy!r}: not 'tiny', 'smollm2-135m', a model directory with config.json or a Hugging Face id (OWNER/NAME)"
    )


def policy_shape(policy: str, base: Path, pulled_only: bool = False) -> ModelShape | None:
    """The shape of a run config's `policy`, from its config.json alone (no weights read; a Hub id's config.json
    is fetched alone). `pulled_only`: None for smollm2-135m not pulled yet (the run pulls it) instead of an error."""
    from loopline.store.db import loopline_home

    if policy == "tiny":  # every tiny starter has the recipe's shape
        shipped = sorted(SHIPPED_STARTERS.glob("*/config.json"))
        return ModelShape.from_dir(shipped[0].parent)
    if policy == "smollm2-135m":
        pulled = loopline_home() / "models" / policy
        if (pulled / "config.json").is_file():
            return ModelShape.from_dir(pulled)
        if pulled_only:
            return None
        raise LooplineError("smollm2-135m is not pulled yet: `loopline models pull smollm2-135m` (or pass its directory)")
    path = Path(policy).expanduser()
    path = path if path.is_absolute() else base / path
    if (path / "config.json").is_file():
        return ModelShape.from_dir(path)
    if HUB_ID.fullmatch(policy) and not path.exists():  # a Hub id: its config.json is enough
        return ModelShape.from_dir(hub_policy(policy, files=["config.json"]))
    if path.exists():
        return ModelShape.from_dir(path)  # (says: no config.json)
    raise unknown_policy(policy)
