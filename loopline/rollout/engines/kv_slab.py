"""KVSlab: the running requests' keys and values, kept in place between decode steps.

Each running request owns a row of one buffer per layer, `[rows, heads, columns, dim]`, its cached
positions right-aligned at the shared column `end`. A decode step writes every row's new key and
value in place at column `end` and attends to columns `[0, end]`, the padding on the left masked
out (keys are cached after RoPE, so where a row sits changes nothing). Re-padding every request's
cache into a fresh batch each step instead copied the whole cache three times a token and faulted in
that fresh memory (SmolLM2, 300-token prompts, batch 32: ~0.5 GB a step; `python -m
benchmarks.kv_slab`: 2.15x the tokens/s, a tenth of the kernel time).

Rows are reused as requests leave and grow in number as they join; the buffer is repacked (live
rows to the front, columns no row needs dropped, room on the right) only when a request does not
fit, the columns run out, or most rows a step would run are free.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values of shape [1, heads, length, dim]


class _SlabLayer(DynamicLayer):
    """One layer's view of the slab for one decode step: `update` writes column `end` in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: int, end: int):
        super().__init__()
        self.slab_keys, self.slab_values, self.rows, self.end = keys, values, rows, end
        self.is_initialized = True
        self.keys, self.values = keys[:rows, :, :end], values[:rows, :, :end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[-2] != 1:
            raise ValueError("the slab takes one new position per row (a decode step)")
        self.slab_keys[: self.rows, :, self.end] = key_states[:, :, 0]
        self.slab_values[: self.rows, :, self.end] = value_states[:, :, 0]
        self.keys = self.slab_keys[: self.rows, :, : self.end + 1]
        self.values = self.slab_values[: self.rows, :, : self.end + 1]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.end


class KVSlab:
    def __init__(self, rows: int, headroom: int = 128):
        self.capacity_rows, self.headroom = rows, headroom
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.owners: list[Hashable | None] = []  # who holds each row (None: free)
        self.cached: list[int] = []  # positions each row holds, right-aligned at `end`
        self.end = 0

    @property
    def rows_used(self) -> int:
        """Rows a decode step runs: up to the last one held (free rows below it run masked)."""
        held = [i for i, owner in enumerate(self.owners) if owner is not None]
        return held[-1] + 1 if held else 0

    def row_of(self, owner: Hashable) -> int:
        return self.owners.index(owner)

    def place(self, owner: Hashable, kv: KV) -> None:
        """Copy `kv` (one request's cache) into a free row."""
        length = kv[0][0].shape[2]
        if None not in self.owners or length > self.end:  # no row free (or none yet), or too long to fit left of `end`
            self._repack(kv, length)
        row = self.owners.index(None)
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][row, :, self.end - length : self.end] = k[0]
            self.values[layer][row, :, self.end - length : self.end] = v[0]
        self.owners[row], self.cached[row] = owner, length

    def take(self, owner: Hashable) -> KV:
        """A copy of the row's cache (for the prefix cache); frees the row."""
        row = self.row_of(owner)
        span = slice(self.end - self.cached[row], self.end)
        kv = [(k[row : row + 1, :, span].clone(), v[row : row + 1, :, span].clone()) for k, v in zip(self.keys, self.values)]
        self.free(owner)
        return kv

    def free(self, owner: Hashable) -> None:
        row = self.row_of(owner)
        self.owners[row], self.cached[row] = None, 0

    def clear(self) -> None:
        self.keys, self.values, self.owners, self.cached, self.end = [], [], [], [], 0

    def decode_inputs(self, last_tokens: dict[Hashable, int]) -> tuple[Cache, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """One decode step's model inputs over rows [0, rows_used): a cache that writes column `end`,
        input ids, attention mask, positions; and each owner's row in `last_tokens` order. The column
        must exist before the step (a full slab is repacked with room first)."""
        live = len(last_tokens)
        if self.end >= self.keys[0].shape[2] or self.rows_used > 2 * live + 4:  # out of columns, or mostly free rows
            self._repack(None, 0)
        rows = self.rows_used
        ids = torch.zeros(rows, 1, dtype=torch.long)
        cached = torch.zeros(rows, dtype=torch.long)  # a free row holds nothing: it attends to its own column only
        order = []
        for owner, token in last_tokens.items():
            row = self.row_of(owner)
            ids[row, 0] = token
            cached[row] = self.cached[row]
            order.append(row)
        mask = (torch.arange(self.end + 1) >= (self.end - cached)[:, None]).long()
        cache = Cache(layers=[_SlabLayer(k, v, rows, self.end) for k, v in zip(self.keys, self.values)])
        return cache, ids, mask, cached[:, None], order

    def advance(self, owners: Sequence[Hashable]) -> None:
        """After a decode step: each of `owners` holds one more position (column `end`, now behind it)."""
        for owner in owners:
            self.cached[self.row_of(owner)] += 1
        self.end += 1

    def _repack(self, incoming: KV | None, length: int) -> None:
        """Live rows to the front, columns no row needs dropped, room for `incoming` and `headroom` steps."""
        live = [i for i, owner in enumerate(self.owners) if owner is not None]
        rows = min(self.capacity_rows, 2 * (len(live) + 1))  # grown as requests join: a long context costs only the rows in use
        if incoming is not None and len(live) >= rows:
            raise RuntimeError(f"the KV slab holds {self.capacity_rows} rows, all in use")
        span = max([self.cached[i] for i in live] + [length, 1])
        template = incoming[0][0] if incoming is not None else self.keys[0]
        _, heads, _, dim = template.shape
        moved = min(span, self.end)  # the old columns that hold any live position: the last `moved` before `end`
        keep = torch.tensor(live, dtype=torch.long)
        for store in (self.keys, self.values):
            for layer in range(len(incoming) if incoming is not None else len(store)):
                fresh = torch.zeros(rows, heads, span + self.headroom, dim, dtype=template.dtype)
                if live:
                    fresh[: len(live), :, span - moved : span] = store[layer][keep, :, self.end - moved : self.end]
                if layer < len(store):
                    store[layer] = fresh
                else:
                    store.append(fresh)
        self.owners = [self.owners[i] for i in live] + [None] * (rows - len(live))
        self.cached = [self.cached[i] for i in live] + [0] * (rows - len(live))
        self.end = span
