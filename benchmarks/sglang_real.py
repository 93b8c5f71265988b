"""SGLang for real: the same generations on a real server and on LocalEngine, then a short run through it.

    python -m benchmarks.sglang_real --server http://127.0.0.1:30010 --model MODEL_DIR [--steps 2]

MODEL_DIR is what the server was started with (its --model-path); the learner exports to a directory
the server must be able to read (same machine or a shared filesystem). Prints, measured in this run:
  1. side by side on the same prompts (the arithmetic env's, as the harness builds them): tokens/s of
     SGLang and of LocalEngine at the same concurrency, and their ratio; greedy ids identical or not;
     the largest |logprob difference| per token;
  2. a `loopline train` run of --steps steps with `engine: {kind: sglang, servers: [SERVER]}` (fresh
     loopline home): per step, rollout seconds and generated tokens/s, learner / checkpoint / export
     seconds, and the weight sync's check / load / confirm seconds (all from the ledger), and the
     learner's logprob gap on the tokens its own weights generated. With --lora RANK the run trains a LoRA
     adapter and ships each version as its adapter (the server must run with --enable-lora --max-lora-rank
     RANK --lora-target-modules all): the gap then checks that the server applied the adapter the learner wrote.
A real server on this 2-core CPU decodes 1-3 tokens/s (docs/sglang-cpu/README.md): keep the sizes small.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


async def _generate_all(engine, prompts: list[list[int]], sampling, concurrency: int, tag: str):
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, ids: list[int]):
        async with gate:
            return await engine.generate(ids, sampling, f"bench-{tag}-{i}")

    started = time.monotonic()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return results, time.monotonic() - started


def side_by_side(server: str, model: Path, prompts: int, concurrency: int, max_new_tokens: int) -> None:
    from loopline.envregistry.spec import load_spec
    from loopline.envregistry.tasks import load_tasks
    from loopline.rollout.harness.chat import ChatFormat
    from loopline.rollout.engines.base import SamplingParams
    from loopline.rollout.engines.local import LocalEngine
    from loopline.rollout.engines.sglang import SGLangEngine

    env = ROOT / "examples" / "arithmetic_env.yaml"
    spec = load_spec(env)
    tasks = [t for t in load_tasks(spec, env.parent) if t.split == "eval"][:prompts]
    chat = ChatFormat.for_policy(model)
    ids = [chat.initial_ids(spec.reset.system_prompt, spec.reset.prompt.replace("{prompt}", t.prompt)) for t in tasks]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)

    async def both():
        remote = SGLangEngine([server])
        local = LocalEngine(model, max_batch=concurrency)
        try:
            await remote.refresh_versions()
            got = {}
            for name, engine in (("sglang", remote), ("local", local), ("sglang ", remote), ("local ", local)):
                results, seconds = await _generate_all(engine, ids, greedy, concurrency, name.strip())
                got.setdefault(name.strip(), []).append((results, seconds))
            return got
        finally:
            await remote.close()
            await local.close()

    got = asyncio.run(both())
    print(f"1. greedy generation, {len(ids)} prompts of the arithmetic env, concurrency {concurrency}, <= {max_new_tokens} new tokens")
    rates = {}
    for name, runs in got.items():
        tokens = sum(len(g.token_ids) for g in runs[0][0])
        rates[name] = [sum(len(g.token_ids) for g in r) / s for r, s in runs]
        print(f"   {name:7s} {tokens} tokens; tokens/s per round: {', '.join(f'{x:.2f}' for x in rates[name])}")
    print(f"   ratio sglang / local (median of rounds): {statistics.median(rates['sglang']) / statistics.median(rates['local']):.3f}")
    remote, local = got["sglang"][0][0], got["local"][0][0]
    same = sum(a.token_ids == b.token_ids for a, b in zip(remote, local))
    diffs = [abs(x - y) for a, b in zip(remote, local) if a.token_ids == b.token_ids for x, y in zip(a.logprobs, b.logprobs)]
    print(f"   greedy ids identical on {same}/{len(remote)} prompts; max |logprob diff| on those {max(diffs, default=0.0):.2e}")


def short_run(
    server: str, model: Path, steps: int, groups: int, group_size: int, max_new_tokens: int, concurrency: int, lora: int | None = None,
    lr: float = 1e-5,
) -> None:

    home = Path(tempfile.mkdtemp(prefix="loopline-sglang-real-"))
    name = f"sglang-real-{int(time.time())}"
    config = home / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "env": str(ROOT / "examples" / "arithmetic_env.yaml"), "policy": str(model), "steps": steps,
        "rollout": {"groups_per_step": groups, "group_size": group_size, "concurrency": concurrency,
                    "sampling": {"temperature": 1.0, "max_new_tokens": max_new_tokens}},
        "learner": {"lr": lr, "backend": "torch", **({"lora": {"rank": lora}} if lora else {})},
        "eval": {"every": steps, "tasks": 4, "temperature": 0.0},
        "engine": {"kind": "sglang", "servers": [server]},
    }))
    env = {**os.environ, "LOOPLINE_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "loopline.cli", "train", str(config)], env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:])
        raise SystemExit(f"the run failed (exit {done.returncode}); its home is {home}")
    os.environ["LOOPLINE_HOME"] = str(home)
    from loopline.store import views
    from loopline.store.db import read_only_engine

    database = read_only_engine()
    with database.connect() as conn:
        run = views.run_id(conn, name)
        table = views.step_timings(conn, run)
        gaps = {(step, n): v for step, n, v in views.metrics(conn, run).rows if n.startswith("logprob_abs_diff")}
    database.dispose()
    shipped = "" if not lora else f", LoRA rank {lora}: each version shipped as its adapter ({_adapter_mib(home, name):.2f} MiB)"
    print(f"\n2. `loopline train` through SGLang: {steps} steps of {groups} groups x {group_size}{shipped}, {wall:.0f} s in all (home {home})")
    columns = table.columns
    for row in table.rows:
        r = dict(zip(columns, row))
        rate = r["tokens"] / r["rollout_s"] if r["rollout_s"] else float("nan")
        print(
            f"   step {r['step']}: rollout {r['rollout_s']:.1f} s ({r['tokens']} tokens, {rate:.2f} tokens/s) · learner {r['learner_s']:.2f} s · "
            f"checkpoint {r['checkpoint_s']:.2f} s · export {r['export_s']:.2f} s · sync {r['sync_s'] or 0:.2f} s "
            f"(check {r['sync_check_s'] or 0:.3f}, load {r['sync_load_s'] or 0:.2f}, confirm {r['sync_confirm_s'] or 0:.3f}) · "
            f"logprob gap {gaps.get((r['step'], 'logprob_abs_diff'), float('nan')):.2e}"
        )
    if lora:  # the gap above is small only if the server applied each adapter; with the base's logprobs it would be this
        print(f"   the same tokens' gap to the base model (adapter not applied): {_base_gap(home, name, model):.2e}")


def _base_gap(home: Path, name: str, model: Path) -> float:
    """Mean |rollout logprob - base model's logprob| over the newest step's trained action tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from loopline.store import ledger
    from loopline.store.db import make_engine, session
    from loopline.pipeline.stages import load_sequences

    database = make_engine()
    with session(database) as s:
        run = ledger.get_run(s, name)
        last = ledger.resume_state(s, run.id).next_learner_step - 1
        sequences = load_sequences(s, ledger.trained_batch(s, run.id, last))
    database.dispose()
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    gaps = []
    for seq in sequences:
        with torch.no_grad():
            lp = torch.log_softmax(base(torch.tensor([list(seq.input_ids)])).logits[0].float(), -1)
        for i, (mask, rollout) in enumerate(zip(seq.action_mask, seq.behaviour_logprobs)):
            if mask and i > 0:
                gaps.append(abs(rollout - lp[i - 1, seq.input_ids[i]].item()))
    return sum(gaps) / len(gaps)


def _adapter_mib(home: Path, name: str) -> float:
    newest = sorted((home / "runs" / name / "adapters").glob("v*"))[-1]
    return sum(f.stat().st_size for f in newest.iterdir()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="a running SGLang server, e.g. http://127.0.0.1:30010")
    parser.add_argument("--model", required=True, type=Path, help="the model directory the server was started with")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--skip-run", action="store_true", help="only the side-by-side generation")
    parser.add_argument("--lr", type=float, default=1e-5, help="the run's learning rate (large: the weights move visibly in 2 steps)")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK", help="the run trains a LoRA adapter of this rank (adapter sync)")
    args = parser.parse_args()
    side_by_side(args.server, args.model, args.prompts, args.concurrency, args.max_new_tokens)
    if not args.skip_run:
        short_run(args.server, args.model, args.steps, args.groups, args.group_size, args.max_new_tokens, args.concurrency, args.lora, args.lr)


if __name__ == "__main__":
    main()
