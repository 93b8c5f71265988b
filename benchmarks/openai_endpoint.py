"""What a model call through the OpenAI-compatible endpoint costs beside the generation itself, side by side.

    python -m benchmarks.openai_endpoint [--calls 200] [--turns 3] [--model DIR]

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

from loopline.pipeline.policies import SHIPPED_STARTERS
from loopline.rollout.chat import ChatFormat
from loopline.rollout.engine import Generation, SamplingParams, VersionSpan
from loopline.rollout.engine_thread import EngineThread
from loopline.rollout.local_engine import LocalEngine
from loopline.rollout.openai_api import AgentEpisode, Budget
from loopline.rollout.openai_server import OpenAIServer


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=120)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="a policy directory (default: the shipped tiny starter)")
    args = parser.parse_args()
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
