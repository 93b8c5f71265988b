"""LocalEngine: dynamic batching that changes nothing, exact logprob semantics, versioned weight updates."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import loopline

from loopline.rollout.engines.base import ContextOverflow, EngineError, SamplingParams, VersionSpan
from loopline.rollout.engines import local as local_engine
from loopline.rollout.engines.kv_slab import KVSlab
from loopline.rollout.engines.local import LocalEngine, load_model

PROMPTS = [[1, 87, 85, 261], [1, 67, 85, 85, 277, 86, 264, 86, 201, 40, 41], [5, 6], [1, 2, 3, 4, 5, 6, 7, 8], [90, 91, 92], [7]]


def _run(coro):
    return asyncio.run(coro)


# a trained policy: a random init's near-uniform outputs barely depend on what attention sees, so a
# wrong mask or a misplaced cached position went unnoticed there (tried)
TRAINED = Path(loopline.__file__).parent / "starters" / "tiny-36f6d034268a-s0"


@pytest.mark.parametrize("headroom", [128, 1], ids=["roomy-slab", "slab-repacked-every-step"])
def test_batched_generation_equals_one_at_a_time_and_a_plain_forward(monkeypatch, headroom):
    # headroom 1: the running caches move to a fresh buffer at nearly every step (rows compacted,
    # columns dropped), and whenever a longer prompt joins: none of it may change a token
    monkeypatch.setattr(local_engine, "KVSlab", functools.partial(KVSlab, headroom=headroom))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)

    async def concurrently():
        engine = LocalEngine(TRAINED, max_batch=4)
        results = await asyncio.gather(*(engine.generate(p, greedy, f"r{i}") for i, p in enumerate(PROMPTS)))
        return results, engine.batch_sizes

    async def alone():
        engine = LocalEngine(TRAINED, max_batch=1)
        return [await engine.generate(p, greedy, f"r{i}") for i, p in enumerate(PROMPTS)]

    batched, sizes = _run(concurrently())
    single = _run(alone())
    assert max(sizes) == 4 and min(sizes) < 4  # requests joined and left the running batch
    for prompt, b, s in zip(PROMPTS, batched, single):
        assert b.token_ids == s.token_ids
        assert max(abs(x - y) for x, y in zip(b.logprobs, s.logprobs)) < 1e-4
        plain = _recompute(TRAINED, prompt, b, 1.0)  # the whole sequence in one forward, no cache
        assert torch.allclose(torch.tensor(b.logprobs), plain, atol=1e-4)


def _recompute(model_dir, prompt, generation, temperature):
    model = load_model(model_dir)
    ids = torch.tensor([list(prompt) + list(generation.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return F.log_softmax(logits, dim=-1).gather(1, torch.tensor(generation.token_ids)[:, None])[:, 0]


def test_recorded_logprobs_match_a_teacher_forced_recompute(tiny_dirs):
    sampling = SamplingParams(temperature=0.7, max_new_tokens=32, seed=3)

    async def go():
        engine = LocalEngine(tiny_dirs["v0"])
        return await asyncio.gather(*(engine.generate(p, sampling, f"r{i}") for i, p in enumerate(PROMPTS)))

    worst = 0.0
    for prompt, gen in zip(PROMPTS, _run(go())):
        assert gen.logprob_semantics == "log_softmax(logits/T)" and gen.version_spans == (VersionSpan(0, 0, len(gen.token_ids)),)
        recomputed = _recompute(tiny_dirs["v0"], prompt, gen, 0.7)
        worst = max(worst, float((recomputed - torch.tensor(gen.logprobs)).abs().max()))
    assert worst < 1e-4, worst  # fp32 on CPU: measured ~1e-6


def test_truncated_sampling_records_both_logprobs(tiny_dirs):
    sampling = SamplingParams(temperature=1.0, top_k=5, max_new_tokens=32, seed=1)

    async def go():
        return await LocalEngine(tiny_dirs["v0"]).generate(PROMPTS[1], sampling, "r")

    gen = _run(go())
    assert gen.sampling_logprobs is not None and len(gen.sampling_logprobs) == len(gen.token_ids)
    assert all(s >= f - 1e-6 for s, f in zip(gen.sampling_logprobs, gen.logprobs))  # renormalised over fewer tokens
    model = load_model(tiny_dirs["v0"])
    ids = torch.tensor([PROMPTS[1] + list(gen.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPTS[1]) - 1 : -1]
    top5 = torch.topk(logits, 5).indices
    assert all(int(t) in top5[i].tolist() for i, t in enumerate(gen.token_ids))


def test_same_seed_same_sample(tiny_dirs):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=42)

    async def go():
        engine = LocalEngine(tiny_dirs["v0"])
        return [await engine.generate(PROMPTS[0], sampling, f"r{i}") for i in range(2)]

    a, b = _run(go())
    assert a.token_ids == b.token_ids


def test_a_stop_string_ends_the_generation_at_the_token_that_completes_it(tiny_dirs):
    """The same seeded sample, once run to its length and once told to stop at a piece of its own text: the
    second is the first cut at the token whose text completes that piece (the endpoint's cut then keeps it all)."""
    from transformers import AutoTokenizer

    from loopline.rollout.harness.chat import ChatFormat
    from loopline.rollout.endpoint.api import cut_at_stop

    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["v0"])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=7)

    async def go(stop):
        engine = LocalEngine(tiny_dirs["v0"])
        return await engine.generate(PROMPTS[1], SamplingParams(**{**vars(sampling), "stop": stop}), "r")

    whole = _run(go(()))
    text = tokenizer.decode(whole.token_ids)
    piece = text[len(tokenizer.decode(whole.token_ids[:8])) :][:3]  # 3 characters from the 9th token's text on
    assert len(piece) == 3 and whole.finish_reason == "length", text
    at = text.index(piece) + len(piece)
    expected = next(n for n in range(1, len(whole.token_ids) + 1) if len(tokenizer.decode(whole.token_ids[:n])) >= at)
    stopped = _run(go((piece,)))
    assert stopped.finish_reason == "stop" and list(stopped.token_ids) == list(whole.token_ids[:expected]) and expected < len(whole.token_ids)
    assert stopped.logprobs == whole.logprobs[:expected]
    kept, said, found = cut_at_stop(ChatFormat.from_tokenizer(tokenizer), list(stopped.token_ids), (piece,))
    assert found and kept == list(stopped.token_ids) and said == text[: text.index(piece)]


@pytest.mark.parametrize("policy", ["finish", "abort", "continue"])
def test_weight_update_policies_never_mix_versions_silently(tiny_dirs, policy):
    long = SamplingParams(temperature=0.0, max_new_tokens=200, stop_token_ids=())

    async def go():
        engine = LocalEngine(tiny_dirs["v0"])
        engine.eos_ids = frozenset()  # make the in-flight request run long enough to overlap the update
        inflight = asyncio.create_task(engine.generate(PROMPTS[0], long, "old"))
        while not engine.batch_sizes:
            await asyncio.sleep(0.01)
        await engine.update_weights(1, tiny_dirs["v1"], in_flight=policy)
        after = await engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=4), "new")
        return await inflight, after, engine.version()

    old, new, version = _run(go())
    assert version == 1 and new.version_spans == (VersionSpan(1, 0, len(new.token_ids)),)
    n = len(old.token_ids)
    if policy == "finish":
        assert old.finish_reason == "length" and old.version_spans == (VersionSpan(0, 0, 200),)
    elif policy == "abort":
        assert old.finish_reason == "abort" and 0 < n < 200 and old.version_spans == (VersionSpan(0, 0, n),)
    else:
        assert old.finish_reason == "length" and old.mixed_versions
        assert [s.version for s in old.version_spans] == [0, 1] and old.version_spans[-1].end == 200


def test_bad_inputs_are_clear_errors(tiny_dirs, tmp_path):
    async def go():
        engine = LocalEngine(tiny_dirs["v0"])
        with pytest.raises(ContextOverflow, match="exceeds the model's context of 1024"):
            await engine.generate([1] * 1000, SamplingParams(max_new_tokens=100), "r")
        with pytest.raises(EngineError, match="do not match the served model"):
            await engine.update_weights(1, tiny_dirs["other"])
        with pytest.raises(EngineError, match="not a model directory"):
            await engine.update_weights(1, tmp_path)
        assert engine.version() == 0

    _run(go())


def test_engine_thread_shares_one_engine_across_threads_and_loops(tiny_dirs):
    """Rollout worker, eval and weight sync run on different threads, each with its own event loop."""
    import threading

    from loopline.rollout.engines.thread import EngineThread

    local = LocalEngine(tiny_dirs["v0"], max_batch=8)
    shared = EngineThread(local)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=1)
    results: dict[str, object] = {}

    def caller(name: str) -> None:  # asyncio.run: a fresh loop per thread, as each Prefect task has
        results[name] = asyncio.run(shared.generate([1, 2, 3], sampling, name))

    threads = [threading.Thread(target=caller, args=(f"r{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert {g.token_ids for g in results.values()} == {results["r0"].token_ids}  # same seed, same prompt
        assert max(local.batch_sizes) > 1  # the four callers were batched together on the one engine
        asyncio.run(shared.update_weights(1, tiny_dirs["v1"]))  # from yet another loop
        assert shared.version() == 1
        after = asyncio.run(shared.generate([1, 2, 3], sampling, "after"))
        assert after.version_spans == (VersionSpan(1, 0, len(after.token_ids)),)
    finally:
        shared.shutdown()
    with pytest.raises(EngineError, match="shut down"):  # an infra failure: the slot is retried elsewhere
        asyncio.run(shared.generate([1, 2, 3], sampling, "closed"))


def test_kv_occupancy_is_recorded_per_decode_step(tiny_dirs):
    """What the concurrency sweep prints beside the plan: the tokens the running requests' caches hold."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, seed=0)

    async def go():
        engine = LocalEngine(tiny_dirs["v0"], max_batch=2)
        engine.eos_ids = frozenset()  # both run to 5 tokens
        await asyncio.gather(engine.generate(PROMPTS[0], sampling, "a"), engine.generate(PROMPTS[1], sampling, "b"))
        return engine.kv_tokens

    prompts = len(PROMPTS[0]) + len(PROMPTS[1])
    assert _run(go()) == [prompts + 2 * k for k in range(1, 5)]  # after the 5th token both have finished


def test_weights_from_memory_serve_like_the_same_weights_from_disk_and_are_copied(tiny_dirs):
    """The in-process sync: the learner's tensors are copied into a new model, so the learner may change its own
    right after; the engine then generates exactly what it generates from the exported directory."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    learner_side = load_model(tiny_dirs["v1"])
    tensors = learner_side.state_dict()

    async def go():
        from_disk, from_memory = LocalEngine(tiny_dirs["v0"]), LocalEngine(tiny_dirs["v0"])
        await from_disk.update_weights(1, tiny_dirs["v1"])
        await from_memory.update_weights(1, tensors)
        with torch.no_grad():
            for p in learner_side.parameters():  # the learner's next step, after the sync returned
                p.add_(1.0)
        pairs = []
        for i, prompt in enumerate(PROMPTS[:3]):
            pairs.append((await from_disk.generate(prompt, greedy, f"d{i}"), await from_memory.generate(prompt, greedy, f"m{i}")))
        return pairs, from_memory.version()

    pairs, version = _run(go())
    assert version == 1
    for disk, memory in pairs:
        assert disk.token_ids == memory.token_ids and disk.logprobs == memory.logprobs


def test_weights_from_memory_of_another_model_are_refused(tiny_dirs):
    from loopline.errors import LooplineError

    async def go():
        engine = LocalEngine(tiny_dirs["v0"])
        with pytest.raises(LooplineError, match="do not fit the served model"):
            await engine.update_weights(1, load_model(tiny_dirs["other"]).state_dict())
        assert engine.version() == 0

    _run(go())


def test_a_prompt_that_starts_with_cached_tokens_runs_only_the_rest_and_generates_the_same(tiny_dirs):
    """First turns share their demonstration (run once), second turns extend the first turn and its
    generation (run only the observation); tokens and logprobs are those of an engine without the cache."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    demonstration = list(range(10, 60))
    first_turns = [demonstration + [61, 62], demonstration + [63], demonstration + [64, 65, 66]]

    async def episodes(engine):
        firsts = await asyncio.gather(*(engine.generate(p, greedy, f"a{i}") for i, p in enumerate(first_turns)))
        seconds = [p + list(g.token_ids) + [70, 71] for p, g in zip(first_turns, firsts)]
        return [*firsts, *await asyncio.gather(*(engine.generate(p, greedy, f"b{i}") for i, p in enumerate(seconds)))]

    cached, plain = LocalEngine(tiny_dirs["v0"], max_batch=4), LocalEngine(tiny_dirs["v0"], max_batch=4, prefix_cache_mb=0)
    for a, b in zip(_run(episodes(cached)), _run(episodes(plain))):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # the demonstration once (50), the first turns' own tokens (2 + 1 + 3), each second turn its last
    # generated token and the observation (3 x 3)
    assert cached.prefill_tokens["computed"] == 50 + 6 + 9
    assert plain.prefill_tokens["reused"] == 0 and plain.prefill_tokens["computed"] > 3 * 52 + 3 * 60


def test_the_prefix_cache_is_dropped_with_the_weights_that_computed_it(tiny_dirs):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompt = list(range(10, 40))

    async def go():
        engine = LocalEngine(tiny_dirs["v0"])
        await engine.generate(prompt, greedy, "a")
        await engine.update_weights(1, tiny_dirs["v1"])
        after = await engine.generate(prompt, greedy, "b")
        return engine.prefill_tokens, after

    counts, after = _run(go())
    fresh = _run(LocalEngine(tiny_dirs["v1"], version=1).generate(prompt, greedy, "c"))
    assert counts == {"computed": 60, "reused": 0}
    assert after.token_ids == fresh.token_ids


def test_prefix_cache_keeps_the_longest_sequence_and_evicts_the_least_recently_used():
    from loopline.rollout.engines.local import _PrefixCache, common_prefix

    assert [common_prefix(a, b) for a, b in (((1, 2, 3), (1, 2, 4)), ((1, 2), (1, 2, 3)), ((5,), (6,)), ((), (1,)))] == [2, 2, 0, 0]
    kv = lambda n: [(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2))]  # noqa: E731
    cache = _PrefixCache(capacity_tokens=10)
    cache.add((1, 2, 3), kv(3))
    cache.add((1, 2, 3, 4, 5), kv(5))  # supersedes (1, 2, 3): every match of it is one of this, as long
    cache.add((1, 2), kv(2))  # already held
    assert list(cache.entries) == [(1, 2, 3, 4, 5)] and cache.tokens == 5
    cache.add((7, 8, 9), kv(3))
    assert cache.longest((1, 2, 3, 9))[0] == 3  # and (1, 2, 3, 4, 5) is now the most recently used
    cache.add((6, 6, 6), kv(3))  # 11 tokens > 10: the least recently used, (7, 8, 9), goes
    assert list(cache.entries) == [(1, 2, 3, 4, 5), (6, 6, 6)] and cache.tokens == 8
    assert cache.longest((4, 4)) == (0, None)


def test_the_kv_slab_holds_memory_for_the_requests_it_runs_not_for_its_capacity():
    slab = KVSlab(32, headroom=8)
    kv = lambda n: [(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)) for _ in range(3)]  # noqa: E731
    first = kv(1000)  # one long request: two rows, not 32
    slab.place("a", first)
    assert slab.keys[0].shape == (2, 2, 1000 + 8, 4)
    for name in "bcdefghij":
        slab.place(name, kv(10))
    assert slab.keys[0].shape[0] == 14 and slab.rows_used == 10  # grown as they joined: 2, 6, 14 rows
    assert all(torch.equal(got, want) for (got, _), (want, _) in zip(slab.take("a"), first))
    for name in "bcdefghi":
        slab.free(name)
    slab.decode_inputs({"j": 7})  # most rows free: compacted, and the columns only the long one needed dropped
    assert slab.rows_used == 1 and slab.keys[0].shape == (4, 2, 10 + 8, 4)


def test_an_idle_engine_drops_its_caches_before_a_sync_steps_learner_and_generates_the_same_after(tiny_dirs):
    """`release_memory` (called by a sync step between its rollouts and its learner, through the engine's thread):
    the slab's rows and the prefix cache are freed once no request runs; the next request builds them again."""
    import time

    from loopline.rollout.engines.thread import EngineThread

    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = [list(range(10, 40)), list(range(10, 30)) + [7, 8]]
    thread = EngineThread(LocalEngine(tiny_dirs["v0"], max_batch=4))
    engine = thread.inner

    async def both():
        return await asyncio.gather(*(thread.generate(p, greedy, f"r{i}") for i, p in enumerate(prompts)))

    try:
        before = asyncio.run(both())
        assert engine._slab.keys and engine._prefixes.tokens > 0
        thread.release_memory()
        deadline = time.monotonic() + 10
        while (engine._slab.keys or engine._prefixes.tokens) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine._slab.keys and engine._prefixes.tokens == 0 and not engine._prefixes.entries
        after = asyncio.run(both())
        assert [g.token_ids for g in after] == [g.token_ids for g in before]
    finally:
        thread.shutdown()


def test_a_sync_steps_engine_lends_its_weights_to_the_learner_and_serves_the_next_version_whole(tiny_dirs):
    """`release_memory(weights=True)` (a sync step, between its rollouts and its learner): the parameters' memory
    is freed; a request before the next version fails rather than run on no weights; the learner's tensors then
    make the engine whole again (tied parameters still one) and it generates as an engine loaded with them."""
    import time

    from loopline.rollout.engines.local import load_model
    from loopline.rollout.engines.thread import EngineThread

    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompt = list(range(10, 40))
    thread = EngineThread(LocalEngine(tiny_dirs["v0"], max_batch=4))
    engine = thread.inner
    learner_tensors = load_model(tiny_dirs["v1"]).state_dict()  # (the next version, as the learner holds it)
    try:
        asyncio.run(thread.generate(prompt, greedy, "before"))
        thread.release_memory(weights=True)
        deadline = time.monotonic() + 10
        while engine._shapes is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(p.numel() for p in engine.model.parameters()) == 0
        with pytest.raises(EngineError, match="released"):
            asyncio.run(thread.generate(prompt, greedy, "weightless"))
        asyncio.run(thread.update_weights(1, learner_tensors))
        learner_tensors["lm_head.weight"].add_(1.0)  # the learner trains on: the engine keeps its own copy
        served = asyncio.run(thread.generate(prompt, greedy, "after"))
    finally:
        thread.shutdown()
    fresh = LocalEngine(tiny_dirs["v1"], max_batch=4)
    expected = asyncio.run(fresh.generate(prompt, greedy, "fresh"))
    assert served.token_ids == expected.token_ids and served.policy_version == 1
    tied = engine.model.config.tie_word_embeddings
    assert (engine.model.lm_head.weight is engine.model.get_input_embeddings().weight) == tied


def test_lent_weights_are_served_as_they_are_and_a_plain_mapping_is_copied(tiny_dirs):
    """A sync step's learner lends its tensors (`LentWeights`): the engine serves them without a copy (one set of
    weights in the process, not two) and generates exactly as an engine loaded with them; tensors handed over
    as a plain mapping are copied, as an async learner goes on changing its own while the engine generates."""
    from loopline.rollout.engines.base import LentWeights
    from loopline.rollout.engines.local import load_model

    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompt = list(range(10, 40))
    learner = load_model(tiny_dirs["v1"]).state_dict()
    lent, given = LocalEngine(tiny_dirs["v0"], max_batch=4), LocalEngine(tiny_dirs["v0"], max_batch=4)
    asyncio.run(lent.update_weights(1, LentWeights(learner)))
    asyncio.run(given.update_weights(1, dict(learner)))
    mine = {name: p.data_ptr() for name, p in lent.model.named_parameters()}
    assert mine and all(mine[name] == learner[name].data_ptr() for name in mine)
    assert not any(p.data_ptr() == learner[name].data_ptr() for name, p in given.model.named_parameters())
    fresh = LocalEngine(tiny_dirs["v1"], max_batch=4)
    expected = asyncio.run(fresh.generate(prompt, greedy, "fresh")).token_ids
    assert asyncio.run(lent.generate(prompt, greedy, "lent")).token_ids == expected
    assert asyncio.run(given.generate(prompt, greedy, "given")).token_ids == expected
