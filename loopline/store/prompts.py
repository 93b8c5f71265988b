"""How a trajectory's prompts are stored, and read back in time and memory linear in what is stored.

Every model call's prompt repeats history its trajectory already holds. A call that continues its chain
(its prompt extends the previous call's prompt and generated ids) stores only what follows them
(`prompt_prefix_len` = the previous call's length). A call that starts a chain (an agent that trimmed,
summarised or re-rendered its history) stores its prompt as *pieces*: copies of spans of earlier calls' ids
and runs of its own stored ids, in order (`prompt_copies`, flat triples `(source seq, start, length)`,
source -1 for the next `length` of its stored ids; stored ids no piece took follow at the end). A
memory-trimming agent's window, a summary's kept turns or a re-rendered message's unchanged prefix are then
copies, and each token is stored about once.

Reading keeps one array per chain (a call's ids are a prefix of its chain's), sized from the rows before it
is filled: each call's whole prompt is `chain[:prompt_len]`, built only where a consumer asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from loopline.errors import LooplineError

LITERAL = -1  # a piece's source: the segment's own stored ids
MATCH = 16  # ids a copy must share at least (a piece costs 3 stored ids); also the index's key length
_HASH = (np.uint64(0x9E3779B97F4A7C15) ** np.arange(MATCH, dtype=np.uint64)).astype(np.uint64)


class StoredPromptBroken(LooplineError):
    """A stored segment's prompt does not reconstruct (a corrupted ledger: `loopline check` names it)."""


@dataclass
class Call:
    """One stored model call as read back: its chain, and where its prompt ends in the chain's array."""

    chain: int
    prompt_len: int
    row: Any  # the stored row (its generated ids, mask and logprobs)


@dataclass
class Decoded:
    """One trajectory's calls and its chains' ids (int32, each exactly as long as its last call's ids)."""

    calls: list[Call]
    chains: list[np.ndarray]

    def prompt(self, call: Call) -> np.ndarray:
        return self.chains[call.chain][: call.prompt_len]


def _ids(values: Any) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else np.asarray(values, dtype=np.int32)


def _pieces(row: Any) -> np.ndarray:
    copies = getattr(row, "prompt_copies", None)
    return np.zeros((0, 3), dtype=np.int64) if copies is None else _ids(copies).astype(np.int64).reshape(-1, 3)


def decode(rows: Sequence[Any]) -> Decoded:
    """One trajectory's stored rows in seq order (each with `seq`, `prompt_ids` (the stored part),
    `prompt_prefix_len`, `prompt_copies`, `generated_ids`, `starts_chain`) as its chains' ids. A row whose
    prefix or pieces do not fit what the calls before it hold is refused (StoredPromptBroken)."""
    chain_of: list[int] = []  # per call
    held: list[int] = []  # per call: ids it holds (prompt and generated)
    lengths: list[int] = []  # per chain
    calls: list[Call] = []
    for i, row in enumerate(rows):
        stored, generated, pieces = len(row.prompt_ids), len(row.generated_ids), _pieces(row)
        if i == 0 or row.starts_chain:
            if row.prompt_prefix_len:
                raise StoredPromptBroken(f"segment {row.seq} starts a chain but stores a prompt after {row.prompt_prefix_len} ids")
            literal = int(pieces[pieces[:, 0] == LITERAL, 2].sum())
            for source, start, n in pieces.tolist():
                if n < 1 or start < 0 or not (source == LITERAL or (0 <= source < i and start + n <= held[source])):
                    raise StoredPromptBroken(
                        f"segment {row.seq} copies ids {start}..{start + n} of segment {source}, which "
                        + (f"holds {held[source]}" if 0 <= source < i else "is not an earlier segment")
                    )
            if literal > stored:
                raise StoredPromptBroken(f"segment {row.seq}'s pieces take {literal} of its {stored} stored ids")
            chain_of.append(len(lengths))
            lengths.append(int(pieces[:, 2].sum()) - literal + stored)
        else:
            if row.prompt_prefix_len != held[i - 1] or len(pieces):
                raise StoredPromptBroken(
                    f"segment {row.seq} stores a prompt after {row.prompt_prefix_len} ids, but segment {rows[i - 1].seq} holds {held[i - 1]}"
                )
            chain_of.append(chain_of[i - 1])
            lengths[-1] += stored
        calls.append(Call(chain_of[i], lengths[chain_of[i]], row))
        lengths[chain_of[i]] += generated
        held.append(lengths[chain_of[i]])
    chains = [np.empty(n, dtype=np.int32) for n in lengths]
    for i, (call, row) in enumerate(zip(calls, rows)):
        chain = chains[call.chain]
        starts = i == 0 or row.starts_chain
        at, stored, taken = 0 if starts else held[i - 1], _ids(row.prompt_ids), 0
        if starts:
            for source, start, n in _pieces(row).tolist():
                if source == LITERAL:
                    chain[at : at + n] = stored[taken : taken + n]
                    taken += n
                else:
                    chain[at : at + n] = chains[chain_of[source]][start : start + n]
                at += n
        chain[at : call.prompt_len] = stored[taken:]
        chain[call.prompt_len : held[i]] = _ids(row.generated_ids)
    return Decoded(calls, chains)


def whole_prompts(rows: Sequence[Any]) -> list[list[int]]:
    """Each stored segment's whole prompt (for a reader that shows every call: the inspector)."""
    decoded = decode(rows)
    return [decoded.prompt(call).tolist() for call in decoded.calls]


class _Index:
    """Where each run of MATCH ids appears in a trajectory's chains (the newest chain wins), so that a new
    chain's prompt finds earlier history by lookup instead of by scanning it."""

    def __init__(self) -> None:
        self.at: dict[int, tuple[int, int]] = {}

    def add(self, chain: int, ids: Sequence[int], offset: int) -> None:
        """Index the windows of `ids`, which sit at `offset` in the chain's ids."""
        keys = _keys(np.asarray(ids, dtype=np.int32))
        self.at.update(zip(keys.tolist(), ((chain, p) for p in range(offset, offset + len(keys)))))


def _keys(ids: np.ndarray) -> np.ndarray:
    if len(ids) < MATCH:
        return np.zeros(0, dtype=np.uint64)
    windows = np.lib.stride_tricks.sliding_window_view(ids.astype(np.uint64), MATCH)
    return windows @ _HASH  # (wraps modulo 2^64: a hash; every hit is compared id by id)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def encode(segments: Sequence[Any]) -> list[tuple[int, list[int] | None, Sequence[int]]]:
    """How to store each of one trajectory's calls (each with whole `prompt_ids`, `generated_ids` and
    `starts_chain`): (prompt_prefix_len, prompt_copies or None, the ids to store). A continuing call stores
    what follows the previous call's ids; a call that starts a chain, its pieces."""
    out: list[tuple[int, list[int] | None, Sequence[int]]] = []
    last: list[int] = []  # per chain: the seq of its last call so far (whose ids hold every earlier call's)
    held = 0  # ids the previous call holds
    index: _Index | None = None  # built at the first call that starts a chain (an appending agent never needs it)
    arrays: dict[int, np.ndarray] = {}  # the last call of a chain's ids, once a new chain looked them up

    def ids(chain: int) -> np.ndarray:
        seq = last[chain]
        if seq not in arrays:
            arrays[seq] = np.asarray([*segments[seq].prompt_ids, *segments[seq].generated_ids], dtype=np.int32)
        return arrays[seq]

    for seq, seg in enumerate(segments):
        if seq == 0 or not seg.starts_chain:
            out.append((held, None, seg.prompt_ids[held:]))
            if seq:
                arrays.pop(last[-1], None)
                last[-1] = seq
            else:
                last.append(0)
            if index is not None:  # (the windows that reach into what this call adds)
                start = max(0, held - MATCH + 1)
                index.add(len(last) - 1, [*seg.prompt_ids[start:], *seg.generated_ids], start)
        else:
            if index is None:
                index = _Index()
                for chain, call in enumerate(last):
                    index.add(chain, [*segments[call].prompt_ids, *segments[call].generated_ids], 0)
            out.append((0, *_pieces_of(np.asarray(seg.prompt_ids, dtype=np.int32), ids, last, index)))
            last.append(seq)
            index.add(len(last) - 1, [*seg.prompt_ids, *seg.generated_ids], 0)
        held = len(seg.prompt_ids) + len(seg.generated_ids)
    return out


def _pieces_of(prompt: np.ndarray, chain_ids: Callable[[int], np.ndarray], last: list[int], index: _Index) -> tuple[list[int] | None, list[int]]:
    """A new chain's prompt as copies of the longest earlier runs found, greedily, and literal runs between."""
    keys = _keys(prompt).tolist()
    pieces: list[int] = []
    literal: list[np.ndarray] = []
    run_start = p = 0  # the literal run not yet closed starts at run_start
    while p < len(keys):
        hit = index.at.get(keys[p])
        n = _common(prompt[p:], chain_ids(hit[0])[hit[1] :]) if hit else 0
        if n < MATCH:
            p += 1
            continue
        if p > run_start:
            pieces += [LITERAL, 0, p - run_start]
            literal.append(prompt[run_start:p])
        pieces += [last[hit[0]], hit[1], n]
        p = run_start = p + n
    literal.append(prompt[run_start:])  # (the stored ids no piece took: they end the prompt)
    return (pieces or None), np.concatenate(literal).tolist()
