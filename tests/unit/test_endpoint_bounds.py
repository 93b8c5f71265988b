"""The agent endpoint under what an adversarial agent program sends: every request it can make is answered
with a status in OpenAI's error shape naming the field (never a 500 or a traceback), a body past the limit is
refused before it is read into memory, and connections that send nothing are closed, so that one episode
cannot take the trainer's memory or file descriptors."""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import time

import httpx
import pytest
from transformers import AutoTokenizer

from loopline.rollout.endpoint import server as openai_server
from loopline.rollout.engines.base import Generation, VersionSpan
from loopline.rollout.endpoint.server import MAX_BODY_BYTES, OpenAIServer
from tests.integration.test_train_flow import STARTER
from tests.unit.test_openai_endpoint import _episode

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STARTER)


@pytest.fixture
def served(tokenizer):
    episode, engine, _ = _episode(tokenizer, [[42]] * 8, max_calls=8)
    with OpenAIServer() as server:
        yield server, server.base_url(server.open(episode)), engine


# request body -> (status, a substring of the error message)
BAD_REQUESTS = {
    "n_not_a_number": ({"messages": USER, "n": "x"}, 400, "n:"),
    "stop_a_number": ({"messages": USER, "stop": 5}, 400, "stop:"),
    "tools_a_string": ({"messages": USER, "tools": "abc"}, 400, "tools:"),
    "tools_without_names": ({"messages": USER, "tools": [{"type": "function", "function": {}}]}, 400, "tools:"),
    "messages_of_numbers": ({"messages": [1, 2]}, 400, "messages[0]"),
    "content_a_number": ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    "content_parts_not_text": ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "messages[0].content"),
    "role_missing": ({"messages": [{"content": "hi"}]}, 400, "messages[0]"),
    "tool_calls_a_string": ({"messages": [*USER, {"role": "assistant", "tool_calls": "x"}]}, 400, "messages[1].tool_calls"),
    "tool_call_id_an_object": ({"messages": [*USER, {"role": "tool", "content": "r", "tool_call_id": {}}]}, 400, "messages[1].tool_call_id"),
    "too_many_messages": ({"messages": USER * 5000}, 400, "at most 4096"),
    "max_tokens_a_string": ({"messages": USER, "max_tokens": "9"}, 400, "max_tokens"),
    "stream_a_string": ({"messages": USER, "stream": "yes"}, 400, "stream:"),
    "a_list_not_an_object": ([1, 2, 3], 400, "must be a JSON object"),
    # would change the answer, cannot be served: refused, never silently ignored (issue 48)
    "response_format_json_schema": ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "not constrained"),
    "response_format_json_object": ({"messages": USER, "response_format": {"type": "json_object"}}, 400, "'json_object' is not served"),
    "top_logprobs": ({"messages": USER, "logprobs": True, "top_logprobs": 3}, 400, "top_logprobs: not served"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_malformed_request_is_a_400_naming_the_field(case, served):
    _, base, engine = served
    body, status, says = BAD_REQUESTS[case]
    response = httpx.post(f"{base}/chat/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert says in response.json()["error"]["message"]
    assert engine.prompts == []  # nothing reached the engine
    episode = served[0].episodes[base.rsplit("/episodes/", 1)[1].split("/")[0]]
    # counted as the program's refusal (an episode with nothing else is a failed task, not infrastructure)
    assert episode.refusals == 1 and episode.refused[0].startswith(f"{status} ") and says in episode.refused[0]


def test_json_nested_100000_deep_is_a_400_not_a_recursion_crash(served):
    _, base, _ = served
    body = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = httpx.post(f"{base}/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"]


def test_a_lone_surrogate_in_a_message_is_replaced_and_the_call_is_served(served, tokenizer):
    _, base, engine = served
    body = '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'  # what json.dumps writes for "a\ud800b"
    response = httpx.post(f"{base}/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 200, response.text
    assert "a\ufffdb" in tokenizer.decode(engine.prompts[0])


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_body_past_the_limit_is_refused_before_it_is_read(served):
    _, base, engine = served
    before = _rss_mb()
    server, path = served[0], base.split(f":{served[0].port}", 1)[1]
    with socket.create_connection((server.host, server.port), timeout=30) as raw:  # declares a terabyte, sends none
        raw.sendall(f"POST {path}/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {10**12}\r\n\r\n".encode())
        assert raw.recv(200).startswith(b"HTTP/1.1 413")

    sent = {"bytes": 0}

    def streamed():  # chunked (no length declared), 4x the limit
        chunk = b" " * (1 << 20)
        for _ in range(4 * MAX_BODY_BYTES // len(chunk)):
            sent["bytes"] += len(chunk)
            yield chunk

    try:
        response = httpx.post(f"{base}/chat/completions", content=streamed(), timeout=30)
        assert response.status_code == 413 and "request_too_large" in response.text
    except httpx.HTTPError:
        pass  # (the server may answer and close before the client finished sending: also a refusal)
    assert engine.prompts == []
    # the server kept no more than the limit: peak RSS of this process (server thread included) grew by less
    # than two limits' worth, though 4 limits were sent
    assert _rss_mb() - before < 2 * MAX_BODY_BYTES / 2**20, (before, _rss_mb(), sent)


def test_connections_that_send_nothing_are_closed_and_their_number_is_bounded(monkeypatch, tokenizer):
    monkeypatch.setattr(openai_server, "HEADERS_S", 1.0)
    monkeypatch.setattr(openai_server, "MAX_CONNECTIONS", 20)
    episode, _, _ = _episode(tokenizer, [[42]] * 2)
    with OpenAIServer() as server:
        base = server.base_url(server.open(episode))
        idle = [socket.create_connection((server.host, server.port)) for _ in range(30)]
        for s in idle:
            s.settimeout(10)
        started = time.monotonic()
        closed_at = []
        for s in idle:
            assert s.recv(1) == b""  # closed by the server: the oldest at once past the bound, the rest after HEADERS_S
            closed_at.append(time.monotonic() - started)
            s.close()
        assert max(closed_at) < 8
        # the endpoint still serves an episode afterwards
        response = httpx.post(f"{base}/chat/completions", json={"messages": USER}, timeout=30)
        assert response.status_code == 200, response.text


def test_the_endpoint_answers_every_status_in_openais_error_shape(served):
    _, base, _ = served
    response = httpx.post(f"{base}/chat/completions", content=b"{not json", timeout=30)
    assert response.status_code == 400
    assert set(json.loads(response.text)["error"]) == {"message", "type", "code"}


class Slow:
    """An engine whose every call takes a while (the agent's requests pile up behind the episode's lock)."""

    def __init__(self, eos: int):
        self.eos = eos

    def version(self) -> int:
        return 0

    async def generate(self, prompt_ids, sampling, request_id):
        await asyncio.sleep(0.5)
        return Generation((42, self.eos), (-1.0, -1.0), "stop", (VersionSpan(0, 0, 2),))


def test_an_episode_with_too_many_requests_open_ends_and_the_others_are_served(tokenizer):
    from loopline.rollout.harness.chat import ChatFormat
    from loopline.rollout.engines.base import SamplingParams
    from loopline.rollout.endpoint.api import AgentEpisode, Budget

    chat = ChatFormat.from_tokenizer(tokenizer)

    def episode(name):
        return AgentEpisode(Slow(chat.eos_id), chat, SamplingParams(temperature=1.0, max_new_tokens=8), Budget(100, 10_000), name)

    greedy, victim = episode("greedy"), episode("victim")
    with OpenAIServer() as server:
        greedy_url, victim_url = server.base_url(server.open(greedy)), server.base_url(server.open(victim))

        async def flood():
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
                post = lambda url: client.post(f"{url}/chat/completions", json={"messages": USER})  # noqa: E731
                return await asyncio.gather(*(post(greedy_url) for _ in range(40)), post(victim_url))

        *flooded, served = asyncio.run(flood())
    codes = [r.status_code for r in flooded]
    assert codes.count(429) >= 40 - openai_server.MAX_REQUESTS_PER_EPISODE and greedy.exhausted == "requests"
    assert served.status_code == 200 and victim.exhausted is None


def test_a_process_that_started_the_endpoint_leaves_no_directory_behind(tmp_path):
    """Each process that started the endpoint left an empty `loopline-model-*` directory (23 had piled up)."""
    import os
    import subprocess
    import sys

    code = "from loopline.rollout.harness.agent_program import endpoint; print(endpoint().unix_path)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(str(tmp_path)), out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_a_path_not_served_is_a_404_in_openais_shape_naming_what_is_served(served):
    """A bare 404 told its user nothing."""
    server, base, engine = served
    response = httpx.post(f"{base}/embeddings", json={"model": "policy", "input": "hi"}, timeout=30)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "not_found" and error["message"].startswith("POST /v1/embeddings is not served") and "/v1/responses" in error["message"]
    assert engine.prompts == []
