"""loopline against TRL's GRPOTrainer on the same work, one after the other: seconds per step, peak memory, disk.

    python -m benchmarks.vs_trl --model DIR --trl-python /path/to/venv/bin/python [--steps 10]

The work (issue 16): the model in DIR (SmolLM2-135M-Instruct from `loopline models pull smollm2-135m`),
single-turn 2-operand arithmetic (the same prompts on both sides: system prompt, the model's few-shot
turns, the question), 8 prompts x 8 samples = 64 completions per step, T=1, 32 new tokens, AdamW lr 1e-6,
one optimizer step per batch, clip 0.2 / 0.28, token-mean loss, no KL, fp32 on CPU.
  loopline: `loopline train` (sync, DeepSpeed ZeRO-1 learner, LocalEngine), its defaults otherwise;
  TRL:      GRPOTrainer(loss_type="dapo", num_iterations=1, use_vllm=False), its defaults otherwise,
            run by --trl-python: a virtual environment with `trl` and this machine's torch (never another).
Medians over steps 2..N (the first step warms up). loopline's parts come from its ledger.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "Solve the problem. Finish with <answer>N</answer>."


def write_work(directory: Path, train: int = 512) -> tuple[Path, list[dict]]:
    """A JSONL task file of 2-operand problems and the single-turn environment over it."""
    rng = random.Random(0)
    rows = []
    for i in range(train + 16):
        a, b, op = rng.randint(1, 79), rng.randint(1, 79), rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"id": f"t{i}", "split": "train" if i < train else "eval", "prompt": f"What is {a} {op} {b}?", "expression": f"{a} {op} {b}", "answer": answer})
    (directory / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {
        "name": "arithmetic-single-turn", "versions": {"env": "1", "verifier": "1", "harness": "1"},
        "sandbox": {"backend": "local"}, "tasks": {"kind": "jsonl", "path": "tasks.jsonl"},
        "reset": {"system_prompt": SYSTEM, "prompt": "{prompt}"},
        "verifier": {"builtin": "arithmetic_answer"}, "budgets": {"max_turns": 1, "max_generated_tokens": 32, "wall_time_s": 120},
    }
    path = directory / "env.yaml"
    path.write_text(yaml.safe_dump(env, sort_keys=False))
    return path, rows


def run_loopline(model: Path, env: Path, steps: int, work: Path) -> dict:
    config = work / "run.yaml"
    name = f"vs-trl-{int(time.time())}"
    config.write_text(yaml.safe_dump({
        "name": name, "env": str(env), "policy": str(model), "steps": steps,
        "rollout": {"mode": "sync", "groups_per_step": 8, "group_size": 8, "concurrency": 64,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 32}},
        "learner": {"lr": 1e-6, "backend": "deepspeed", "loss": {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token_mean"}},
        "eval": {"every": steps, "tasks": 16, "temperature": 0.0},
    }))
    home = work / "loopline-home"
    env_vars = {**os.environ, "LOOPLINE_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "loopline.cli", "train", str(config)], env=env_vars, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"loopline failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024**2

    os.environ["LOOPLINE_HOME"] = str(home)
    from loopline.store import views
    from loopline.store.db import read_only_engine

    database = read_only_engine()
    with database.connect() as conn:
        run = views.run_id(conn, name)
        timings = views.step_timings(conn, run)
        written_versions = views.written_versions(conn, run)
    database.dispose()
    every = [dict(zip(timings.columns, r)) for r in timings.rows]
    rows = every[1:]
    step_seconds = [b["committed_at"] - a["committed_at"] for a, b in zip(every, every[1:])]  # steps 2..N, commit to commit
    runs = home / "runs" / name
    size = lambda p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())  # noqa: E731
    checkpoints = sorted((runs / "checkpoints").glob("step-*"))
    exports = sorted((runs / "weights").glob("v*"))
    checkpoint_bytes = size(checkpoints[-1]) if checkpoints else 0
    export_bytes = size(exports[-1]) if exports else 0
    # what the ledger says was written over the run (older ones were pruned), times the newest one's size
    written = written_versions["checkpoints"] * checkpoint_bytes + written_versions["exports"] * export_bytes
    return {
        "step_s": statistics.median(step_seconds),
        "generation_s": statistics.median(r["rollout_s"] for r in rows),
        "learner_s": statistics.median(r["learner_s"] + r["checkpoint_s"] + r["export_s"] for r in rows),
        "peak_gb": peak_gb,
        "disk_per_step_gb": written / steps / 1e9,
        "wall_s": wall,
    }


TRL_SCRIPT = textwrap.dedent('''
    import json, resource, sys, time
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tasks, steps, out, system = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    few_shot = []
    try:
        few_shot = json.load(open(model + "/loopline_prompt.json")).get("few_shot", [])
    except OSError:
        pass
    rows = [json.loads(l) for l in open(tasks) if json.loads(l)["split"] == "train"]
    data = Dataset.from_list([
        {"prompt": [{"role": "system", "content": system}] + few_shot + [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
        for r in rows
    ])

    def reward(completions, answer, **kw):
        import re
        out = []
        for c, a in zip(completions, answer):
            text = c[-1]["content"] if isinstance(c, list) else c
            m = re.search(r"<answer>\\s*(-?\\d+)\\s*</answer>", text)
            out.append(1.0 if m and int(m.group(1)) == a else 0.0)
        return out

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []
        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.monotonic())

    clock = Clock()
    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=64, gradient_accumulation_steps=1, num_generations=8,
        max_completion_length=32, temperature=1.0, learning_rate=1e-6, loss_type="dapo", num_iterations=1,
        epsilon=0.2, epsilon_high=0.28, beta=0.0, use_vllm=False, max_steps=steps, logging_steps=1,
        save_strategy="no", report_to=[], bf16=False, use_cpu=True, seed=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, callbacks=[clock])
    start = time.monotonic()
    trainer.train()
    steps_s = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    print(json.dumps({"steps_s": steps_s, "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
                      "wall_s": time.monotonic() - start}))
''')


def run_trl(python: str, model: Path, tasks: Path, steps: int, work: Path) -> dict:
    script = work / "trl_grpo.py"
    script.write_text(TRL_SCRIPT)
    done = subprocess.run([python, str(script), str(model), str(tasks), str(steps), str(work / "trl-out"), SYSTEM], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"TRL failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"step_s": statistics.median(result["steps_s"]), "peak_gb": result["peak_gb"], "wall_s": result["wall_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--trl-python", required=True, help="python of a venv with trl (pip install trl -c <(echo torch==2.13.0))")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="loopline-vs-trl-"))
    env, _ = write_work(work)
    ours = run_loopline(args.model, env, args.steps, work)
    theirs = run_trl(args.trl_python, args.model, work / "tasks.jsonl", args.steps, work)
    print(f"\n{'':32s} {'loopline':>10s} {'TRL':>10s} {'loopline/TRL':>13s}")
    print(f"{'seconds per step (median 2..N)':32s} {ours['step_s']:10.1f} {theirs['step_s']:10.1f} {ours['step_s'] / theirs['step_s']:13.2f}")
    print(f"{'  generation':32s} {ours['generation_s']:10.1f} {'':>10s}")
    print(f"{'  learner + checkpoint + export':32s} {ours['learner_s']:10.1f} {'':>10s}")
    print(f"{'peak RSS (GB)':32s} {ours['peak_gb']:10.2f} {theirs['peak_gb']:10.2f} {ours['peak_gb'] / theirs['peak_gb']:13.2f}")
    print(f"{'disk written per step (GB)':32s} {ours['disk_per_step_gb']:10.2f} {'-':>10s}")
    print(f"{'wall, whole run (s)':32s} {ours['wall_s']:10.0f} {theirs['wall_s']:10.0f}")
    print(f"(work directory {work})")


if __name__ == "__main__":
    main()
