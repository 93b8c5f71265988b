"""Logprobs of a micro-batch whose rows share prompts: each shared prefix goes through the model once.

The samples of a group start with the same prompt (the system prompt and the task), and in GRPO's
usual shapes the prompt is most of the tokens (the SmolLM2 arithmetic run: 49 of 78 tokens). Recomputing it for
every sample is the learner's largest avoidable cost. Here the rows are grouped by the tokens before
their first action token; each distinct prefix (minus its last token) is run once with the KV cache
on, the cache is expanded to the rows that share it, and each row's suffix (from the prefix's last
token on, so that every position predicting an action token is in it) runs on top with its true
positions. Gradients flow through the shared cache into the prefix, so the update is the one the
rows would give separately (the tests compare them); only the FLOPs differ.

Both passes use caches that give the same answer when a layer runs again: with gradient checkpointing
(`learner.gradient_checkpointing`) each layer's forward is replayed during the backward pass, and a plain
DynamicCache would append the replayed keys a second time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer

from loopline.trainer.batch import Padded

SUFFIX_PASS_OVERHEAD = 96  # tokens of time one more suffix pass costs: the race's step took 108-124 s at 96 and at 0, 164 s in one pass
ModelCall = Callable[..., Any]  # the model (or the DeepSpeed engine) called with keyword arguments
# (the model's output at some positions, their target tokens, a list for their entropy or None, a mask of the positions
# wanted or None: all) -> log π(target)
Score = Callable[[torch.Tensor, torch.Tensor, "list | None", "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class PrefixPlan:
    first: torch.Tensor  # [B] each row's prefix length: its first position that predicts an action token
    group: torch.Tensor  # [B] index of the row's prefix among the distinct prefixes
    prefixes: list[tuple[int, ...]]
    saved_tokens: int  # tokens not run again thanks to the sharing


class _FillLayer(DynamicLayer):
    """The prefix pass: attends to its own keys only; keeps the first forward's states, not a replay's."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _PrefixedLayer(DynamicLayer):
    """The suffix pass: attends to the fixed prefix plus its own keys, and stores nothing. The prefixes stay one per
    group; each call picks its rows' copies (inside the layer: under gradient checkpointing they are made again in
    backward instead of living through the pass, 18 MB a row in the race's model)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.rows = keys, values, rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # index_select, not `keys[rows]`: the rows' gradients are summed back into their shared prefix by its backward
        # (index_add_, in row order) where advanced indexing's backward adds them with atomic float adds from several
        # threads, in an order that changes with the machine's load (a replay or a resume could then not rebuild the
        # weights a step recorded)
        keys, values = self.keys.index_select(0, self.rows), self.values.index_select(0, self.rows)
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)


def suffix_chunks(lengths: list[int], overhead: int | None = None) -> list[list[int]]:
    """The rows of a micro-batch in suffix passes, longest first, each pass padded to its longest row: the partition
    that minimises the tokens run (padding included) plus `overhead` per pass (what one more, smaller pass through
    every layer costs, in tokens). One pass for all pads every suffix to the longest: in the race's steps (suffixes of
    12 to 200 tokens) that ran 56% more suffix tokens than the rows hold."""
    overhead = SUFFIX_PASS_OVERHEAD if overhead is None else overhead
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: the cost of the first j rows (in `order`)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # rows i..j-1 in one pass, padded to row i's length
            cost = best[i] + (j - i) * lengths[order[i]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    chunks, j = [], n
    while j > 0:
        chunks.append(order[cut[j] : j])
        j = cut[j]
    return chunks[::-1]


def plan(batch: Padded) -> PrefixPlan | None:
    """Which rows share which prefix; None when no two rows share one (nothing to save)."""
    targets = batch.target_mask.bool()
    has = targets.any(-1)
    if not has.all():
        return None
    first = targets.int().argmax(-1)  # position t predicts token t + 1: the prompt is ids[: t + 1]
    if bool((first == 0).any()):  # a row with no prompt before its first action: no prefix to share
        return None
    keys: dict[tuple[int, ...], int] = {}
    group = []
    for row in range(targets.shape[0]):
        key = tuple(batch.input_ids[row, : int(first[row])].tolist())
        group.append(keys.setdefault(key, len(keys)))
    saved = int(first.sum()) - sum(len(k) for k in keys)
    if len(keys) == targets.shape[0] or saved <= 0:
        return None
    return PrefixPlan(first, torch.tensor(group), list(keys), saved)


def shared_prefix_logprobs(
    call: ModelCall, layers: int, batch: Padded, prefix: PrefixPlan, score: Score, device: torch.device,
    entropy: list | None = None,
) -> torch.Tensor:
    """[B, L-1] log π(token t+1 | tokens ≤ t) at the action positions (0 elsewhere), as `Learner._logprobs`
    (and the entropy there, appended to `entropy` if given); `layers`: the model's decoder layers (one cache
    layer each); `score`: what the model's output at the kept positions and their targets make logprobs with."""
    rows, width = batch.target_mask.shape
    lengths = batch.attention_mask.sum(-1)
    # the distinct prefixes, right-padded; a row's padding slots are masked out of its attention
    longest = max((len(p) for p in prefix.prefixes), default=0)
    prefix_ids = torch.zeros(len(prefix.prefixes), max(longest, 1), dtype=torch.long)
    prefix_mask = torch.zeros_like(prefix_ids)
    for g, tokens in enumerate(prefix.prefixes):
        prefix_ids[g, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        prefix_mask[g, : len(tokens)] = 1
    # each row's suffix: from its first action-predicting position to its end
    suffix_len = lengths - prefix.first
    span = int(suffix_len.max())
    suffix_ids = torch.zeros(rows, span, dtype=torch.long)
    suffix_mask = torch.zeros_like(suffix_ids)
    suffix_targets = torch.zeros(rows, span, dtype=torch.bool)
    for r in range(rows):
        start, n = int(prefix.first[r]), int(suffix_len[r])
        suffix_ids[r, :n] = batch.input_ids[r, start : start + n]
        suffix_mask[r, :n] = 1
        upto = min(n, width - start)
        suffix_targets[r, :upto] = batch.target_mask[r, start : start + upto].bool()
    next_ids = torch.zeros_like(suffix_ids)
    next_ids[:, :-1] = suffix_ids[:, 1:]  # the token each suffix position predicts

    filled = None
    if longest > 0:
        filled = Cache(layers=[_FillLayer() for _ in range(layers)])
        call(input_ids=prefix_ids.to(device), attention_mask=prefix_mask.to(device), cache=filled, use_cache=True, logits_to_keep=1)
    picked, entropies, order = [], [], []
    for chunk in suffix_chunks(suffix_len.tolist()):
        values, entropy_of = _suffix_pass(call, filled, prefix, prefix_mask, torch.tensor(chunk), suffix_ids, suffix_mask, suffix_targets,
                                          next_ids, score, device, entropy is not None, width)
        picked.append(values)
        entropies.append(entropy_of)
        order += chunk
    back = torch.argsort(torch.tensor(order)).to(device)  # (the passes' rows -> the batch's rows; index_select: see _PrefixedLayer)
    if entropy is not None:
        entropy.append(torch.cat(entropies).index_select(0, back))
    return torch.cat(picked).index_select(0, back)


def _suffix_pass(call: ModelCall, filled: Cache | None, prefix: PrefixPlan, prefix_mask: torch.Tensor, rows: torch.Tensor,
                 suffix_ids: torch.Tensor, suffix_mask: torch.Tensor, suffix_targets: torch.Tensor, next_ids: torch.Tensor,
                 score: Score, device: torch.device, with_entropy: bool, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rows`' suffixes on top of their prefixes' caches: their logprobs (and entropy) as the batch's [len(rows), L-1]."""
    span = int(suffix_mask[rows].sum(-1).max())
    ids, mask, targets = suffix_ids[rows, :span], suffix_mask[rows, :span], suffix_targets[rows, :span]
    first = prefix.first[rows]
    if filled is not None:
        group = prefix.group[rows]
        cache = Cache(layers=[_PrefixedLayer(f.keys, f.values, group.to(device)) for f in filled.layers])
        attention = torch.cat([prefix_mask[group], mask], dim=1)
    else:
        cache, attention = None, mask
    keep = targets.any(0).nonzero().squeeze(-1)
    positions = first[:, None] + torch.arange(span)[None, :]
    output = call(
        input_ids=ids.to(device), attention_mask=attention.to(device), position_ids=positions.to(device),
        cache=cache, use_cache=cache is not None, logits_to_keep=keep.to(device),
    ).logits
    entropies: list = []
    picked = score(output, next_ids[rows][:, keep].to(device), entropies if with_entropy else None, targets[:, keep].to(device))

    def in_rows(values: torch.Tensor) -> torch.Tensor:  # suffix positions -> the batch's [rows, L-1]
        wide = torch.zeros(len(rows), int(first.max()) + span, dtype=torch.float32, device=device)
        wide = wide.scatter(1, (first[:, None] + keep[None, :]).to(device), values * targets[:, keep].to(device))
        return wide[:, :width] if wide.shape[1] >= width else torch.nn.functional.pad(wide, (0, width - wide.shape[1]))

    return in_rows(picked), (in_rows(entropies[0]) if with_entropy else None)
