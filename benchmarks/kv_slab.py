"""LocalEngine's decode: caches kept in place (KVSlab) vs re-padded into a fresh batch every step.

    python -m benchmarks.kv_slab --model DIR [--prompt-tokens 300] [--rounds 2]

The same 64 requests (8 prompts x 8 samples, as a group of the SmolLM2 arithmetic run: a shared
few-shot-sized prefix, 48 new tokens, EOS ignored, fixed seeds) through the engine as it is and
through `RepaddingEngine`, the decode this replaced (each request's cache apart, left-padded and
concatenated into one batch per step, split back after), alternated. Prints tokens/s, the process's
user and kernel CPU seconds (the fresh ~0.5 GB a step cost page faults), and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import torch
import torch.nn.functional as F

from loopline.rollout.engines.base import SamplingParams
from loopline.rollout.engines.local import LocalEngine, sample_token


class RepaddingEngine(LocalEngine):
    """The decode before KVSlab, for comparison only: every request keeps its own cache."""

    @torch.inference_mode()
    def _step(self, admit):
        if admit:
            self._prefill(admit)
        self._active.extend(admit)
        finished, running = [], []
        for request in self._active:
            token, logprob, _ = sample_token(request.next_logits, request.sampling, request.generator)
            request.tokens.append(token)
            request.logprobs.append(logprob)
            request.versions.append(request.logits_version)
            if len(request.tokens) >= request.sampling.max_new_tokens:
                request.finish = "length"
            (finished if request.finish else running).append(request)
            if request.finish and request.kv_version == self._version:
                self._prefixes.add(request.prompt_ids + request.tokens[:-1], request.kv)
        self._active = running
        if running:
            self._decode(running)
        return finished

    def _decode(self, batch):
        from transformers import DynamicCache

        lengths = [r.length - 1 for r in batch]
        longest = max(lengths)
        cache = DynamicCache(config=self.model.config)
        for layer in range(len(batch[0].kv)):
            keys = [F.pad(r.kv[layer][0], (0, 0, longest - n, 0)) for r, n in zip(batch, lengths)]
            values = [F.pad(r.kv[layer][1], (0, 0, longest - n, 0)) for r, n in zip(batch, lengths)]
            cache.update(torch.cat(keys), torch.cat(values), layer)
        mask = torch.tensor([[0] * (longest - n) + [1] * (n + 1) for n in lengths])
        out = self.model(
            torch.tensor([[r.tokens[-1]] for r in batch]), cache=cache, attention_mask=mask,
            position_ids=torch.tensor([[n] for n in lengths]), use_cache=True, logits_to_keep=1,
        )
        for i, (request, n) in enumerate(zip(batch, lengths)):
            request.kv = [(l.keys[i : i + 1, :, longest - n :], l.values[i : i + 1, :, longest - n :]) for l in out.cache.layers]
            request.next_logits = out.logits[i, -1]


def generate(engine_class, model: str, prompt_tokens: int) -> dict:
    engine = engine_class(model, max_batch=32)
    engine.eos_ids = frozenset()
    shared = [(31 * i) % 4000 + 100 for i in range(prompt_tokens - 20)]
    prompts = [shared + [(17 * p + 3 * i) % 4000 + 100 for i in range(20)] for p in range(8)]

    async def run():
        return await asyncio.gather(*(
            engine.generate(prompts[p], SamplingParams(temperature=1.0, max_new_tokens=48, seed=8 * p + k), f"r{p}-{k}")
            for p in range(8) for k in range(8)
        ))

    before, started = os.times(), time.perf_counter()
    results = asyncio.run(run())
    wall, after = time.perf_counter() - started, os.times()
    tokens = sum(len(r.token_ids) for r in results)
    return {"tokens_s": tokens / wall, "wall_s": wall, "user_s": after.user - before.user, "kernel_s": after.system - before.system}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory, e.g. the pulled SmolLM2 (LOOPLINE_HOME/models/smollm2-135m)")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="prompt length (the SmolLM2 arithmetic few-shot prompt: ~300)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    variants = {"re-padded every step": RepaddingEngine, "KVSlab (in place)": LocalEngine}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, engine_class in variants.items():
            runs[name].append(generate(engine_class, args.model, args.prompt_tokens))
    print(f"64 requests x 48 tokens, prompts of {args.prompt_tokens} tokens, torch threads {torch.get_num_threads()}, {args.rounds} rounds (median)")
    print(f"{'decode':24s} {'tokens/s':>9s} {'wall s':>7s} {'user s':>7s} {'kernel s':>9s}")
    medians = {}
    for name, rows in runs.items():
        medians[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        m = medians[name]
        print(f"{name:24s} {m['tokens_s']:9.1f} {m['wall_s']:7.1f} {m['user_s']:7.1f} {m['kernel_s']:9.1f}")
    old, new = (medians[name]["tokens_s"] for name in variants)
    print(f"KVSlab / re-padded tokens/s: {new / old:.2f}x")


if __name__ == "__main__":
    main()
