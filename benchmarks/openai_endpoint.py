"""What a model call through the OpenAI-compatible endpoint costs beside the generation itself, side by side;
and what one attacking episode does to another's calls.

    python -m benchmarks.openai_endpoint [--calls 200] [--turns 3] [--model DIR]
    python -m benchmarks.openai_endpoint --abuse [--seconds 20]

`--abuse`: a victim episode makes calls one after another (the instant engine, through the real `openai` SDK)
while one attacking episode, in a process of its own as an agent program would be, does each of:
  none        nothing (the victim's baseline);
  slowloris   1,040 connections, each sending its request's headers one byte every 5 s;
  large       one request after another of 12 MiB of message text (within every bound: the body limit is 16 MiB);
  tools       one request after another declaring 100,000 tools.
Prints the victim's p50 / p99 / max latency and failed calls under each, and this process's RSS (the endpoint
runs in it) before and after.

Three ways to make the same multi-turn calls (each conversation: a system and a user message, then the reply
appended with a tool result, `--turns` calls), alternated in rounds so machine noise hits them alike:
  direct    the engine's `generate` on the ids the harness would build (no HTTP, no template);
  endpoint  the real `openai` SDK -> loopline's endpoint over HTTP -> the same engine;
both once with an instant engine (it returns a fixed reply: what is left is the endpoint's own cost: HTTP,
JSON, the chat template, the chain check) and once with the real tiny policy on LocalEngine (what a
generation of up to 32 tokens costs here). Prints median ms per call and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from loopline.policies.sources import SHIPPED_STARTERS
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import Generation, SamplingParams, VersionSpan
from loopline.rollout.engines.thread import EngineThread
from loopline.rollout.engines.local import LocalEngine
from loopline.rollout.endpoint.api import AgentEpisode, Budget
from loopline.rollout.endpoint.server import OpenAIServer


class Instant:
    def __init__(self, reply: list[int]):
        self.reply = tuple(reply)

    def version(self) -> int:
        return 0

    async def generate(self, prompt_ids, sampling, request_id):
        return Generation(self.reply, tuple([-1.0] * len(self.reply)), "stop", (VersionSpan(0, 0, len(self.reply)),))


def conversations(turns: int):
    system = {"role": "system", "content": "Solve the problem. Compute with <calc>EXPRESSION</calc>; finish with <answer>N</answer>."}
    return [system, {"role": "user", "content": "What is 12 + 34 * 2?"}], turns


def direct(engine, chat: ChatFormat, sampling: SamplingParams, calls: int, turns: int) -> list[float]:
    async def run():
        times = []
        for c in range(calls // turns):
            ids = chat.initial_ids("Solve the problem.", "What is 12 + 34 * 2?")
            for t in range(turns):
                started = time.perf_counter()
                gen = await engine.generate(ids, sampling, f"d{c}/{t}/")
                times.append(time.perf_counter() - started)
                ids = ids + list(gen.token_ids) + chat.observation_ids("<result>80</result>", list(gen.token_ids))
        return times

    return asyncio.run(run())


def through_endpoint(engine, chat: ChatFormat, sampling: SamplingParams, calls: int, turns: int, server: OpenAIServer) -> list[float]:
    import openai

    times = []
    for c in range(calls // turns):
        episode = AgentEpisode(engine, chat, sampling, Budget(turns, 10_000), f"e{c}")
        client = openai.OpenAI(base_url=server.base_url(server.open(episode)), api_key="x")
        messages, _ = conversations(turns)
        for _ in range(turns):
            started = time.perf_counter()
            reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
            times.append(time.perf_counter() - started)
            messages = messages + [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "<result>80</result>"}]
    return times


def half_open(host: str, port: int, seconds: float, connections: int = 1040, every_s: float = 5.0) -> None:
    """An attacker's connections that send their request's headers a byte every `every_s`, reconnecting when one
    is closed (tests/integration/test_endpoint_fairness.py plays it too)."""
    import socket

    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nobody\r\n"
    held: list[socket.socket | None] = []
    for _ in range(connections):
        try:
            held.append(socket.create_connection((host, port), timeout=5))
        except OSError:
            held.append(None)
    end, sent = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for i, s in enumerate(held):
            try:
                if s is None:
                    raise OSError
                s.send(request[sent % len(request) : sent % len(request) + 1])
            except OSError:  # closed by the endpoint: reconnect, as an attacker would
                try:
                    held[i] = socket.create_connection((host, port), timeout=5)
                except OSError:
                    held[i] = None
        sent += 1
        time.sleep(every_s)


def heavy(base_url: str, kind: str, seconds: float) -> None:
    """One request after another, each within every bound: `large` 12 MiB of message text, `tools` 100,000 tools."""
    import httpx

    if kind == "large":
        body = {"messages": [{"role": "user", "content": "word " * ((12 << 20) // 5)}]}
    else:
        tools = [{"type": "function", "function": {"name": f"t{i}", "description": "", "parameters": {"type": "object"}}} for i in range(100_000)]
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            httpx.post(f"{base_url}/chat/completions", json=body, timeout=120)
        except httpx.HTTPError:
            pass


def _attack(kind: str, server: OpenAIServer, base_url: str, seconds: float):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    if kind == "slowloris":
        return context.Process(target=half_open, args=(server.host, server.port, seconds))
    return context.Process(target=heavy, args=(base_url, kind, seconds))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def abuse(seconds: float) -> None:
    import resource

    import httpx

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    model = str(next(p for p in SHIPPED_STARTERS.iterdir() if (p / "config.json").is_file()))
    chat = ChatFormat.for_policy(model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32)
    instant = Instant(chat.tokenizer.encode("<calc>12 + 34 * 2</calc>", add_special_tokens=False) + [chat.eos_id])
    print(f"victim's calls while one episode attacks ({seconds:g} s each; threads: {threading.active_count()})")
    print(f"  {'abuse':10s} {'calls':>6s} {'failed':>6s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s} {'RSS MB before/after':>20s}")
    with OpenAIServer() as server:
        for kind in ("none", "slowloris", "large", "tools"):
            attacker = AgentEpisode(instant, chat, sampling, Budget(1_000_000, 10**9), f"attacker-{kind}")
            key = server.open(attacker)
            process = None if kind == "none" else _attack(kind, server, server.base_url(key), seconds)
            before = _rss_mb()
            if process is not None:
                process.start()
                time.sleep(2)  # (the attack under way)
            times, failed, end, n = [], 0, time.monotonic() + seconds, 0
            with httpx.Client(timeout=60) as client:
                while time.monotonic() < end:
                    victim = AgentEpisode(instant, chat, sampling, Budget(100, 100_000), f"victim-{kind}-{n}")
                    url = server.base_url(server.open(victim))
                    n += 1
                    for _ in range(50):
                        started = time.perf_counter()
                        try:
                            ok = client.post(f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "What is 12 + 34 * 2?"}]}).status_code == 200
                        except httpx.HTTPError:
                            ok = False
                        times.append(time.perf_counter() - started)
                        failed += not ok
                        if time.monotonic() >= end:
                            break
            if process is not None:
                process.terminate()
                process.join()
            server.close(key)  # (the attacker's episode ends, as at the end of its budget)
            while attacker.requests_open:  # (its last request, abandoned by its client, served to its end)
                time.sleep(0.2)
            del attacker
            time.sleep(1)
            times.sort()
            p = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1000  # noqa: E731
            print(f"  {kind:10s} {len(times):6d} {failed:6d} {p(0.5):8.1f} {p(0.99):8.1f} {times[-1] * 1000:8.1f} {before:9.0f} / {_rss_mb():.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--abuse", action="store_true", help="the victim's latency under each abuse instead")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--calls", type=int, default=120)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="a policy directory (default: the shipped tiny starter)")
    args = parser.parse_args()
    if args.abuse:
        abuse(args.seconds)
        return
    model = args.model or str(next(p for p in SHIPPED_STARTERS.iterdir() if (p / "config.json").is_file()))
    chat = ChatFormat.for_policy(model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32)
    instant = Instant(chat.tokenizer.encode("<calc>12 + 34 * 2</calc>", add_special_tokens=False) + [chat.eos_id])
    real = EngineThread(LocalEngine(model, version=0, max_batch=1))
    results: dict[str, list[float]] = {}
    with OpenAIServer() as server:
        for _ in range(args.rounds):
            for name, engine in (("instant", instant), ("tiny", real)):
                calls = args.calls if name == "instant" else max(args.calls // 4, args.turns)
                results.setdefault(f"{name} direct", []).extend(direct(engine, chat, sampling, calls, args.turns))
                results.setdefault(f"{name} endpoint", []).extend(through_endpoint(engine, chat, sampling, calls, args.turns, server))
    real.shutdown()
    median = {k: statistics.median(v) * 1000 for k, v in results.items()}
    print(f"median ms per call ({args.turns}-call conversations, {args.rounds} alternated rounds; threads: {threading.active_count()})")
    for key, value in median.items():
        print(f"  {key:16s} {value:8.2f} ms  ({len(results[key])} calls)")
    overhead = median["instant endpoint"] - median["instant direct"]
    generation = median["tiny direct"]
    print(f"endpoint's own cost per call: {overhead:.2f} ms; a tiny-policy call through it / direct: "
          f"{median['tiny endpoint'] / generation:.2f}; own cost / a tiny generation: {overhead / generation:.3f}")


if __name__ == "__main__":
    main()
