"""Issue 63: a call that starts a chain stores its prompt as pieces of what its trajectory already holds, so a
memory-trimming or re-rendering agent stores each token about once; every reader rebuilds the prompts exactly
and refuses rows that do not fit. Hand-computed cases, then random agents."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from loopline.store.prompts import LITERAL, StoredPromptBroken, decode, encode, whole_prompts


def _call(prompt, generated, starts_chain=False):
    return SimpleNamespace(prompt_ids=list(prompt), generated_ids=list(generated), starts_chain=starts_chain)


def _rows(calls):
    """The ledger's rows for these calls, as commit writes them."""
    return [
        SimpleNamespace(seq=i, prompt_ids=np.asarray(stored, dtype=np.int32), prompt_prefix_len=prefix,
                        prompt_copies=None if copies is None else np.asarray(copies, dtype=np.int32),
                        generated_ids=np.asarray(c.generated_ids, dtype=np.int32), starts_chain=i > 0 and c.starts_chain)
        for i, (c, (prefix, copies, stored)) in enumerate(zip(calls, encode(calls)))
    ]


def _stored(rows) -> int:
    return sum(len(r.prompt_ids) + len(r.generated_ids) + (0 if r.prompt_copies is None else len(r.prompt_copies)) for r in rows)


SYSTEM = list(range(1000, 1040))  # 40 ids
ANSWER = list(range(2000, 2030))


def test_a_re_rendered_answer_is_stored_as_the_history_it_kept_and_what_changed():
    # call 1 re-rendered call 0's answer: its last 2 ids differ (a stop sequence trimmed, re-tokenised)
    first = _call(SYSTEM, ANSWER)
    second = _call([*SYSTEM, *ANSWER[:-2], 7, 8, 9, 9], [5], starts_chain=True)
    (_, none, _), (prefix, copies, stored) = encode([first, second])
    assert none is None and prefix == 0
    assert copies == [0, 0, 40 + 28] and stored == [7, 8, 9, 9]  # (call 0's ids 0..68, then its own 4)
    assert whole_prompts(_rows([first, second])) == [first.prompt_ids, second.prompt_ids]


def test_pieces_copy_from_any_earlier_call_and_keep_new_ids_where_they_stand():
    a = _call(SYSTEM, ANSWER)
    b = _call(list(range(3000, 3020)), list(range(4000, 4020)), starts_chain=True)  # a sub-agent's own chain
    # back to the first history, with something new between two copied runs: SYSTEM, [1, 2], b's 40 ids
    c = _call([*SYSTEM, 1, 2, *b.prompt_ids, *b.generated_ids], [3], starts_chain=True)
    rows = _rows([a, b, c])
    assert rows[2].prompt_copies.tolist() == [0, 0, 40, LITERAL, 0, 2, 1, 0, 40] and rows[2].prompt_ids.tolist() == [1, 2]
    assert whole_prompts(rows) == [a.prompt_ids, b.prompt_ids, c.prompt_ids]
    assert rows[1].prompt_copies is None  # (nothing it shares: stored whole)


def test_a_run_shorter_than_a_copy_is_stored_as_it_is():
    a = _call(SYSTEM[:10], ANSWER[:5])
    b = _call(SYSTEM[:10], [1], starts_chain=True)
    assert encode([a, b])[1] == (0, None, SYSTEM[:10])


def test_rows_that_do_not_fit_what_the_calls_before_hold_are_refused_by_name():
    a, b = _call(SYSTEM, ANSWER), _call([*SYSTEM[:20], 1], [2], starts_chain=True)
    rows = _rows([a, b])
    assert rows[1].prompt_copies.tolist() == [0, 0, 20]
    rows[1].prompt_copies = np.asarray([0, 60, 20], dtype=np.int32)  # past the 70 ids call 0 holds
    with pytest.raises(StoredPromptBroken, match="segment 1 copies ids 60..80 of segment 0, which holds 70"):
        decode(rows)
    rows[1].prompt_copies = np.asarray([1, 0, 1], dtype=np.int32)  # itself
    with pytest.raises(StoredPromptBroken, match="not an earlier segment"):
        decode(rows)
    rows[1].prompt_copies = np.asarray([LITERAL, 0, 5], dtype=np.int32)  # more of its own ids than it stored
    with pytest.raises(StoredPromptBroken, match="take 5 of its 1 stored ids"):
        decode(rows)
    c = _rows([a, _call([*SYSTEM, *ANSWER, 3], [4])])
    c[1].prompt_prefix_len = 69
    with pytest.raises(StoredPromptBroken, match="segment 1 stores a prompt after 69 ids, but segment 0 holds 70"):
        decode(c)


def test_a_sliding_window_agent_stores_about_what_an_appending_one_stores():
    rng = random.Random(0)
    turns, calls = [], []
    for n in range(40):  # each call sees the system prompt and the last 6 turns
        generated = [rng.randrange(50_000) for _ in range(40)]
        calls.append(_call([*SYSTEM, *(x for t in turns[-6:] for x in t)], generated, starts_chain=n > 0))
        turns.append([*generated, *(rng.randrange(50_000) for _ in range(30))])
    rows = _rows(calls)
    appending = len(SYSTEM) + 40 * 70
    assert _stored(rows) <= 1.1 * appending  # (whole prompts: 5.3x)
    assert sum(len(c.prompt_ids) + len(c.generated_ids) for c in calls) > 5 * appending
    assert whole_prompts(rows) == [c.prompt_ids for c in calls]


@pytest.mark.parametrize("seed", range(60))
def test_any_agent_history_reads_back_exactly(seed):
    """Random agents: they append, trim, re-render and switch between threads; every prompt comes back."""
    rng = random.Random(seed)
    word = lambda n: [rng.randrange(64) for _ in range(n)]  # noqa: E731 (a small vocabulary: many false hash neighbours)
    threads = [word(rng.randrange(1, 60))]
    calls = []
    for _ in range(rng.randrange(1, 25)):
        k = rng.randrange(len(threads))
        history, move = threads[k], rng.choice(["append", "append", "trim", "rerender", "fork"])
        if move == "trim" and len(history) > 4:
            a = rng.randrange(len(history))
            history = history[:a] + history[a + rng.randrange(1, len(history) - a + 1):]
        elif move == "rerender" and history:
            history = history[: rng.randrange(len(history))] + word(rng.randrange(0, 8))
        elif move == "fork":
            history, k = word(rng.randrange(1, 40)), len(threads)
            threads.append(history)
        call = _call(history + word(rng.randrange(0, 20)), word(rng.randrange(0, 20)))
        previous = [*calls[-1].prompt_ids, *calls[-1].generated_ids] if calls else None
        call.starts_chain = previous is not None and (call.prompt_ids[: len(previous)] != previous or rng.random() < 0.1)
        calls.append(call)
        threads[k] = [*call.prompt_ids, *call.generated_ids]
    rows = _rows(calls)
    assert whole_prompts(rows) == [c.prompt_ids for c in calls]
    decoded = decode(rows)
    for call, c in zip(decoded.calls, calls):
        chain = decoded.chains[call.chain]
        assert chain[call.prompt_len : call.prompt_len + len(c.generated_ids)].tolist() == c.generated_ids
