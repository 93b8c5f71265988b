"""LocalEngine against transformers' own `generate` on issue 16's work, side by side.

    python -m benchmarks.generation --model DIR [--rounds 2]

64 requests (8 prompts of 49 tokens x 8 samples, as GRPO groups), 32 new tokens each, T=1, every request
in one batch. Rounds alternate the two so machine noise hits both alike. LocalEngine must also join and
leave requests between decode steps and return exact logprobs and version spans, which `generate` does
not; this measures what that costs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from loopline.rollout.engines.base import SamplingParams
    from loopline.rollout.engines.local import LocalEngine

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(49)] for _ in range(8)]
    requests = [p for p in prompts for _ in range(8)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32)

    async def engine_round() -> float:
        engine = LocalEngine(args.model, max_batch=64)
        started = time.perf_counter()
        generations = await asyncio.gather(*(engine.generate(p, sampling, f"r{i}") for i, p in enumerate(requests)))
        seconds = time.perf_counter() - started
        await engine.close()
        return sum(len(g.token_ids) for g in generations) / seconds

    def generate_round() -> float:
        ids = torch.tensor(requests)
        with torch.inference_mode():
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=32, pad_token_id=0)
            seconds = time.perf_counter() - started
        return (out.shape[1] - ids.shape[1]) * len(requests) / seconds

    rates: dict[str, list[float]] = {"LocalEngine": [], "generate": []}
    for _ in range(args.rounds):
        rates["LocalEngine"].append(asyncio.run(engine_round()))
        rates["generate"].append(generate_round())
    for name, values in rates.items():
        print(f"{name:12s} tokens/s per round: {', '.join(f'{v:.1f}' for v in values)}")
    ratio = statistics.median(rates["LocalEngine"]) / statistics.median(rates["generate"])
    print(f"LocalEngine / generate tokens/s (median): {ratio:.2f}")


if __name__ == "__main__":
    main()
