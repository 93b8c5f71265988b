"""SGLangEngine against the protocol-faithful test server (no real SGLang can run here; see the server's docstring)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from loopline.rollout.engines.base import ContextOverflow, EngineError, SamplingParams, VersionSpan
from loopline.rollout.engines.sglang import SGLangEngine


@pytest.fixture
def server():
    from tests.fakes.sglang_protocol_server import serving

    with serving() as s:
        yield s


def _run(coro):
    return asyncio.run(coro)


async def _with(urls, body, **kw):
    engine = SGLangEngine(urls, **kw)
    try:
        return await body(engine)
    finally:
        await engine.close()


def test_sglang_client_against_protocol_server_generates_token_ids_with_logprobs(server, tmp_path):
    sampling = SamplingParams(temperature=0.8, max_new_tokens=20, seed=7, stop_token_ids=(999,))

    async def body(engine):
        return await engine.generate([1, 2, 3], sampling, "ep/t0/")

    gen = _run(_with([server.url], body))
    sent = server.requests[-1]  # it passed SGLang's own GenerateRequest schema
    assert sent["input_ids"] == [1, 2, 3] and sent["return_logprob"] is True and sent["rid"] == "ep/t0/"
    assert sent["sampling_params"] == {"max_new_tokens": 20, "temperature": 0.8, "top_p": 1.0, "stop_token_ids": [999], "sampling_seed": 7}
    assert len(gen.token_ids) == len(gen.logprobs) == 20 and gen.finish_reason == "length"
    assert gen.version_spans == (VersionSpan(0, 0, 20),)  # "default" is the initial version
    assert gen.logprob_semantics == "log_softmax(logits/T)"


def test_sglang_client_against_protocol_server_unknown_sampling_key_is_400(server):
    response = httpx.post(f"{server.url}/generate", json={"input_ids": [1], "sampling_params": {"top_kk": 3}})
    assert response.status_code == 400 and "unknown field `top_kk`" in response.json()["error"]["message"]


def test_sglang_client_against_protocol_server_maps_errors(server):
    async def too_long(engine):
        await engine.generate([1] * 500, SamplingParams(max_new_tokens=100), "r/")

    with pytest.raises(ContextOverflow, match="maximum context length"):
        _run(_with([server.url], too_long))

    async def bad_weights(engine):
        await engine.update_weights(1, "/does/not/exist")

    with pytest.raises(EngineError, match="refused /update_weights_from_disk .*/does/not/exist does not exist on the server's machine"):
        _run(_with([server.url], bad_weights))

    async def down(engine):
        await engine.generate([1], SamplingParams(max_new_tokens=2), "r/")

    with pytest.raises(EngineError, match="unreachable"):
        _run(_with(["http://127.0.0.1:9"], down))


@pytest.mark.parametrize("policy", ["finish", "abort", "continue"])
def test_sglang_client_against_protocol_server_weight_update_policies(server, tmp_path, policy):
    async def body(engine):
        inflight = asyncio.create_task(engine.generate([5, 6], SamplingParams(max_new_tokens=60), "old/"))
        while not server.running:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        await engine.update_weights(1, str(tmp_path), in_flight=policy)
        after = await engine.generate([5, 6], SamplingParams(max_new_tokens=3), "new/")
        return await inflight, after, engine.version()

    old, new, version = _run(_with([server.url], body))
    assert version == 1 and new.version_spans == (VersionSpan(1, 0, 3),)
    if policy == "finish":  # the update waited for the in-flight request
        assert old.finish_reason == "length" and old.version_spans == (VersionSpan(0, 0, 60),)
    elif policy == "abort":  # HTTP 200 with the partial ids
        assert old.finish_reason == "abort" and 0 < len(old.token_ids) < 60 and not old.mixed_versions
    else:  # retract: the request resumed under the new weights, and the spans say so
        assert old.finish_reason == "length" and [s.version for s in old.version_spans] == [0, 1]


def test_sglang_client_against_protocol_server_in_place_flush_is_refused(server, tmp_path):
    async def body(engine):
        inflight = asyncio.create_task(engine.generate([5], SamplingParams(max_new_tokens=50), "r/"))
        while not server.running:
            await asyncio.sleep(0.005)
        async with httpx.AsyncClient() as raw:
            await raw.post(f"{server.url}/pause_generation", json={"mode": "in_place"})
            refused = await raw.post(
                f"{server.url}/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "1", "flush_cache": True}
            )
            no_body = await raw.post(f"{server.url}/pause_generation")
            await raw.post(f"{server.url}/continue_generation", json={})
        await inflight
        return refused, no_body, await engine.refresh_versions()

    refused, no_body, versions = _run(_with([server.url], body))
    assert refused.status_code == 400 and "not flushed" in refused.json()["message"]
    assert versions == [0]  # the version did not advance
    assert no_body.status_code == 400


def test_sglang_client_against_protocol_server_abort_matches_the_exact_rid(server):
    async def body(engine):
        first = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=80), "ep/t1/"))
        other = asyncio.create_task(engine.generate([2], SamplingParams(max_new_tokens=80), "ep/t10/"))
        while len(server.running) < 2:
            await asyncio.sleep(0.005)
        await engine.abort("ep/")  # a prefix aborts nothing on a real server
        await engine.abort("ep/t1/")
        return await first, await other

    first, other = _run(_with([server.url], body))
    assert first.finish_reason == "abort" and other.finish_reason == "length"


def test_sglang_client_against_protocol_server_tracks_each_replica(tmp_path):
    from tests.fakes.sglang_protocol_server import SGLangProtocolServer, load_api_types

    if load_api_types() is None:
        pytest.skip("sglang's schema classes are not installed")
    with SGLangProtocolServer() as a, SGLangProtocolServer() as b:
        a.weight_version = "2"

        async def body(engine):
            before = await engine.refresh_versions()
            oldest = engine.version()
            gens = await asyncio.gather(*(engine.generate([i], SamplingParams(max_new_tokens=5), f"r{i}/") for i in range(4)))
            await engine.update_weights(3, str(tmp_path))
            return before, oldest, gens, engine.version()

        before, oldest, gens, after = _run(_with([a.url, b.url], body))
    assert before == [2, 0] and oldest == 0 and after == 3
    assert {g.meta["replica"] for g in gens} == {a.url, b.url}  # load was spread
    assert a.weight_version == b.weight_version == "3"


def test_sglang_client_does_not_trust_a_version_of_another_run(tmp_path):
    """A server left serving another run's v5 (or an untagged "5") is not this run's v5: the first sync replaces it."""
    from tests.fakes.sglang_protocol_server import SGLangProtocolServer, load_api_types

    if load_api_types() is None:
        pytest.skip("sglang's schema classes are not installed")
    with SGLangProtocolServer() as other, SGLangProtocolServer() as bare, SGLangProtocolServer() as ours:
        other.weight_version, bare.weight_version, ours.weight_version = "5@aaaa1111", "5", "5@bbbb2222"

        async def body(engine):
            before = await engine.refresh_versions()
            await engine.update_weights(5, str(tmp_path))
            return before, await engine.refresh_versions()

        before, after = _run(_with([other.url, bare.url, ours.url], body, initial_version=0, tag="bbbb2222"))
    assert before == [-1, -1, 5] and after == [5, 5, 5]
    assert other.weight_version == bare.weight_version == "5@bbbb2222"


def test_a_stop_string_ends_an_sglang_generation_at_the_token_that_completes_it(tmp_path):
    """SGLang checks `stop` itself (observed on a real 0.5.23 server: its output ids run through the token
    that completes the string, only its text is trimmed): the client passes it, and the same seeded sample cut
    there is what comes back."""
    from transformers import AutoTokenizer

    from loopline.policies.sources import SHIPPED_STARTERS
    from tests.fakes.sglang_protocol_server import serving

    model = next(p for p in SHIPPED_STARTERS.iterdir() if (p / "config.json").is_file())
    tokenizer = AutoTokenizer.from_pretrained(model)
    with serving(token_delay_s=0.0, model_path=str(model), deterministic=True) as server:
        def generate(stop):
            sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=7, stop=stop)
            return _run(_with([server.url], lambda engine: engine.generate([1, 87, 85, 261], sampling, "ep/t0/")))

        whole = generate(())
        text = tokenizer.decode(whole.token_ids)
        piece = text[len(tokenizer.decode(whole.token_ids[:3])) :][:3]  # 3 characters from the 4th token's text on
        stopped = generate((piece,))
        assert server.requests[-1]["sampling_params"]["stop"] == [piece]
    at = text.index(piece) + len(piece)
    expected = next(n for n in range(1, len(whole.token_ids) + 1) if len(tokenizer.decode(whole.token_ids[:n])) >= at)
    assert stopped.finish_reason == "stop" and expected < len(whole.token_ids)
    assert list(stopped.token_ids) == list(whole.token_ids[:expected]) and stopped.logprobs == whole.logprobs[:expected]
