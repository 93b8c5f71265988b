"""Wall-clock to held-out success, loopline against TRL's GRPOTrainer on the same tool-using task (issue 50).

    python -m benchmarks.race_vs_trl --trl-python VENV/bin/python --seed S [--minutes 20] [--mark-minutes 5] [--modes sync,async]
    python -m benchmarks.race_vs_trl --trl-from RAW --seed S ...   # loopline's sides only, TRL's from an earlier raw file
    python -m benchmarks.race_vs_trl --combine        # every seed's raw file -> the medians, the spread, one plot

TRL's venv, as users install it (this machine's torch, never another):
    python3 -m venv --system-site-packages VENV && VENV/bin/pip install trl==1.16.0 -c <(echo torch==2.13.0)

The work, the same on every side: SmolLM2-135M-Instruct (`loopline models pull smollm2-135m`), the arithmetic
tasks with operands up to --max-operand (2,000 train, the first --eval-tasks held-out; at 9999 the base model
solves 47% greedy, at 79 83%: room to learn rather than a one-step race), a `calc` tool, two worked examples before each question (a
tool call, its result, the answer), the env's verifier (`<answer>N</answer>` in the final message), 8 prompts x 8
samples a step, T = --temperature, lr --lr (3e-6) constant, clip 0.2 / 0.28, token-mean loss, no KL, one optimizer step
a step in micro-batches of --micro-batch completions (16: TRL's per_device_train_batch_size with gradient
accumulation; loopline's micro_batch_tokens set to as many rows of prompt + --max-tokens), fp32 on CPU. The prompt is checked token
for token to be the same on both sides. SmolLM2's chat template drops tools and TRL refuses it ("The provided
chat template does not support tool calling"); with TRL's Qwen2.5 template SmolLM2 answers the worked examples'
pattern wrongly (0% greedy: it writes `<tool_response>` for `<tool_call>`). So both sides get
`benchmarks/race_smollm2_tools.jinja`: SmolLM2's ChatML with the tools shown as loopline's endpoint shows them to
SmolLM2 (Hermes's tool prompt in the system message, `<tool_call>` blocks, `tool` turns), and TRL gets the
response parser of its Qwen templates (`<tool_call>` JSON), set by hand as TRL's error message says to.
  loopline: `loopline train` (its built-in harness, the template's Hermes tool calls, DeepSpeed learner,
            LocalEngine), default home (embedded Postgres), each --mode in turn;
  TRL:      `GRPOTrainer(tools=[calc])` as its docs show (benchmarks/race_trl_side.py, in TRL's venv).
Each side trains for --minutes of wall-clock from its process start, one after the other, nothing else running;
at every --mark-minutes the policy it has then counts (on both sides the newest one whose step ended before the
mark: every loopline version is exported, TRL saves after every step), the time spent saving off the clock on
both sides. Afterwards one evaluator (greedy, the same harness and
engine for every checkpoint) measures held-out success at each mark. Writes benchmarks/results/race_vs_trl/seed-S.{json,txt,png}.

Memory is measured alike on every side (benchmarks/_memory.py): the peak, sampled every second, of the summed PSS
of every process of the side (loopline: the train process, its children, and the embedded PostgreSQL, found by its
home directory; TRL: its process tree), in GiB.

Token limits. TRL 1.16 (grpo_trainer.py, `_tool_call_loop`) counts `max_completion_length` over the whole
completion: the model's tokens and the tool results (with their template tokens); a first call may use all of it.
loopline's `max_generated_tokens` counts the model's tokens only, and `max_new_tokens` bounds one call. With both at
128 (--max-tokens), loopline's episodes may hold a tool result's tokens more than TRL's: a few tokens here (a
number and its turn's markers), stated with the results.

Seeds (--seed) run one at a time, at different times if need be; `--combine` reads every seed's raw file. Each raw
file records a machine probe (fp32 matmuls a second, measured alone before the race): the same code once ran 1.75x
slower here from one day to the next, so `--trl-from` takes TRL's side only from a file whose probe is within 10%
of this machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks._memory import TreeMemory

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "race_vs_trl"
AGENTS = ROOT / "examples" / "agents"
SYSTEM = "Solve the problem. Use the calc tool to compute. Finish with <answer>N</answer>."
WORKED = (("What is 23 * 4?", "23 * 4", "92"), ("What is 56 - 18 + 7?", "56 - 18 + 7", "45"))


def _call(expression: str) -> str:
    return json.dumps({"name": "calc", "arguments": {"expression": expression}})


def few_shot_turns() -> list[dict]:
    """The worked examples as loopline's `few_shot` turns: the text the template renders for TRL's structured
    tool calls (checked token for token by `check_same_prompt`)."""
    turns = []
    for question, expression, value in WORKED:
        turns += [{"role": "user", "content": question},
                  {"role": "assistant", "content": f"<tool_call>\n{_call(expression)}\n</tool_call>"},
                  {"role": "tool", "content": value},
                  {"role": "assistant", "content": f"<answer>{value}</answer>"}]
    return turns


def trl_messages(question: str) -> list[dict]:
    """The same conversation as TRL takes it: OpenAI-style tool calls and tool messages."""
    messages = [{"role": "system", "content": SYSTEM}]
    for q, expression, value in WORKED:
        messages += [{"role": "user", "content": q},
                     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expression": expression}}}]},
                     {"role": "tool", "name": "calc", "content": value},
                     {"role": "assistant", "content": f"<answer>{value}</answer>"}]
    return messages + [{"role": "user", "content": question}]


def prepare_model(work: Path) -> Path:
    """SmolLM2 with a chat template that renders tools (see the docstring)."""
    from transformers import AutoTokenizer

    from benchmarks.smollm2_learning import pulled_model
    from loopline.store.db import loopline_home

    model = work / "smollm2-tools-template"
    shutil.copytree(pulled_model(loopline_home()), model)
    (model / "loopline_prompt.json").unlink(missing_ok=True)  # (the worked examples come from the run config)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = (ROOT / "benchmarks" / "race_smollm2_tools.jinja").read_text()
    tokenizer.save_pretrained(model)
    return model


def write_env(work: Path, eval_size: int, max_operand: int, max_tokens: int) -> Path:
    spec = {
        "name": "race-arithmetic-tools", "versions": {"env": "1", "verifier": "1", "harness": "race-1"},
        "sandbox": {"backend": "local"},
        "tasks": {"kind": "generator", "generator": "arithmetic", "seed": 0, "train_size": 2000, "eval_size": max(eval_size, 16),
                  "params": {"max_operand": max_operand, "split": "problems"}},
        "tools": [{"name": "calc", "description": "Evaluate an arithmetic expression.", "builtin": "calculator", "timeout_s": 2,
                   "args": {"expression": {"type": "string", "description": 'numbers and + - * / ( ), e.g. "12 + 3 * 4".'}}}],
        "tool_calls": "hermes",
        "reset": {"system_prompt": SYSTEM, "prompt": "{prompt}"},
        "verifier": {"builtin": "arithmetic_answer"},
        "budgets": {"max_turns": 4, "max_generated_tokens": max_tokens, "wall_time_s": 120},
    }
    path = work / "env.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def check_same_prompt(model: Path, env: Path, task) -> tuple[str, int]:
    """Both sides' first prompt for one task, as token ids: identical (what is said, and its length), or the race stops."""
    import dataclasses

    from transformers import AutoTokenizer

    from loopline.envregistry.spec import load_spec
    from loopline.rollout.harness.actions import tool_schemas
    from loopline.rollout.harness.chat import ChatFormat

    from benchmarks.race_trl_side import as_trl_tool

    sys.path.insert(0, str(AGENTS))
    from calc_tool import calc

    chat = dataclasses.replace(ChatFormat.for_policy(model), few_shot=tuple(few_shot_turns())).with_tools(tool_schemas(load_spec(env).tools))
    ours = chat.initial_ids(SYSTEM, task.prompt)
    tokenizer = AutoTokenizer.from_pretrained(model)
    theirs = tokenizer.encode(tokenizer.apply_chat_template(trl_messages(task.prompt), tools=[as_trl_tool(calc)], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    if ours == theirs:
        return f"prompts identical ({len(ours)} tokens)", len(ours)
    extra = tokenizer.decode(theirs[len(os.path.commonprefix([ours, theirs])):][:40])
    raise SystemExit(f"the sides' prompts differ: loopline {len(ours)} tokens, TRL {len(theirs)}; TRL's from there: {extra!r}")


def race_loopline(model: Path, env: Path, mode: str, seconds: float, mark_s: float, work: Path, temperature: float, seed: int,
                  max_tokens: int, lr: float, micro_batch_tokens: int) -> dict:
    name = f"race-{mode}-{int(time.time())}"
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump({
        "name": name, "env": str(env), "policy": str(model), "steps": 10_000, "seed": seed,
        "rollout": {"mode": mode, "groups_per_step": 8, "group_size": 8, "concurrency": 32,
                    "sampling": {"temperature": temperature, "max_new_tokens": max_tokens}, "few_shot": few_shot_turns()},
        "learner": {"lr": lr, "backend": "deepspeed", "export_every": 1, "keep_exports": 10_000, "micro_batch_tokens": micro_batch_tokens},
        "eval": {"every": 10_000, "tasks": 1, "temperature": 0.0},  # (v0 is evaluated on 1 task: the run's own evaluations are off)
    }, sort_keys=False))
    home = work / f"home-{mode}"
    env_vars = {k: v for k, v in os.environ.items() if k != "LOOPLINE_DATABASE_URL"} | {"LOOPLINE_HOME": str(home)}
    started_wall, started = time.time(), time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "loopline.cli", "train", str(config)], env=env_vars, cwd=work,
                               stdout=open(work / f"{name}.out", "w"), stderr=subprocess.STDOUT)
    memory = TreeMemory(process.pid, marks=[str(home)])
    while process.poll() is None and time.monotonic() - started < seconds + 30:  # (a step committed just past the budget is not used)
        time.sleep(2)
    measured = memory.stop()  # (before the stop: its embedded ledger is then stopped, whatever the side held is counted)
    if process.poll() is None:
        # SIGTERM stops the run where it is, resumable, as Ctrl-C does; a race started in the background (`cmd &`)
        # has SIGINT ignored, passed on to its children: its side trained on past the budget
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=300)
    return loopline_side(name, mode, home, started_wall, model, seconds, mark_s) | {"memory": measured}


def loopline_side(name: str, mode: str, home: Path, started_wall: float, model: Path, seconds: float, mark_s: float) -> dict:
    """A loopline side's results, from its run's ledger: each version's commit on the side's clock (seconds from
    its process start, less the exports written so far), the policy at each mark, its peak memory. Read in a
    process of its own: a process keeps the first embedded ledger it opened (the other side's home)."""
    import multiprocessing

    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply(_read_side, (name, mode, home, started_wall, model, seconds, mark_s))
    finally:  # (close, not terminate: the worker exits normally and stops the embedded ledger it started)
        pool.close()
        pool.join()


def _read_side(name: str, mode: str, home: Path, started_wall: float, model: Path, seconds: float, mark_s: float) -> dict:
    os.environ["LOOPLINE_HOME"] = str(home)
    os.environ.pop("LOOPLINE_DATABASE_URL", None)
    from loopline.store import db as store_db
    from loopline.store import ledger, views
    from loopline.store.uris import path_on_publisher

    database = store_db.make_engine()
    with database.connect() as conn:
        run = views.run_id(conn, name)
        timings = [dict(zip(t.columns, r)) for t in [views.step_timings(conn, run)] for r in t.rows]
    with store_db.session(database) as s:
        weights = {v: path_on_publisher(ledger.version_weights(s, run, v).uri) for v in ledger.exported_versions(s, run) if v > 0}
    database.dispose()
    # every version is exported here only so that each mark can be evaluated (a run normally exports every 4th)
    saved, trained = 0.0, {}
    for row in timings:
        saved += row["export_s"] or 0.0
        trained[row["step"]] = row["committed_at"] - started_wall - saved
    policies = {0: {"trained_s": 0.0, "path": str(model), "version": 0}} | {
        v: {"trained_s": t, "path": weights[v], "version": v} for v, t in trained.items() if v in weights}
    rows = timings[1:] or timings
    return {
        "side": f"loopline {mode}", "marks": at_marks(policies, seconds, mark_s), "base": str(model),
        "steps": len(timings), "steps_in_budget": sum(t <= seconds for t in trained.values()),
        "startup_s": (timings[0]["committed_at"] - started_wall - (timings[0]["rollout_s"] or 0) - (timings[0]["learner_s"] or 0)) if timings else None,
        "median_step": {part: statistics.median((r[part] or 0.0) for r in rows) for part in ("rollout_s", "learner_s", "checkpoint_s", "export_s", "sync_s")} if rows else {},
        "export_s_total": saved,
    }


def at_marks(policies: dict[int, dict], seconds: float, mark_s: float) -> list[dict]:
    """The policy each side has at each mark: the newest whose step ended (on that side's clock) before it."""
    marks = []
    for k in range(1, int(seconds // mark_s + 1e-9) + 1):
        newest = max((n for n, p in policies.items() if p["trained_s"] <= k * mark_s), default=0)
        marks.append({"mark": k, "at_s": k * mark_s, **policies[newest]})
    return marks


def race_trl(trl_python: str, model: Path, tasks: list, seconds: float, mark_s: float, work: Path, temperature: float, seed: int,
             max_tokens: int, micro_batch: int, lr: float) -> dict:
    prompts = work / "trl_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": trl_messages(t.prompt), "answer": t.data["answer"]}) + "\n" for t in tasks))
    out = work / "trl"
    command = [trl_python, str(ROOT / "benchmarks" / "race_trl_side.py"), "--model", str(model), "--prompts", str(prompts),
               "--tool-module", str(AGENTS), "--out", str(out), "--budget-s", str(seconds),
               "--temperature", str(temperature), "--max-new-tokens", str(max_tokens), "--seed", str(seed), "--micro-batch", str(micro_batch), "--lr", str(lr)]
    with open(work / "trl.out", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=work, env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
        memory = TreeMemory(process.pid)
        process.wait()
        measured = memory.stop()
    if process.returncode != 0:
        raise SystemExit(f"TRL failed (rc {process.returncode}); its output: {work / 'trl.out'}")
    result = json.loads((out / "steps.json").read_text())
    ends = [step["trained_s"] for step in result["steps"]]
    policies = {0: {"trained_s": 0.0, "path": str(model), "step": 0}} | {step["step"]: step for step in result["steps"]}
    return {
        "side": "TRL", "base": str(model), "memory": measured, "steps": len(ends),
        "steps_in_budget": sum(t <= seconds for t in ends), "marks": at_marks(policies, seconds, mark_s),
        "startup_s": result.get("startup_s"),  # (measured by the TRL side: process start to training start)
        "median_step": {"step_s": statistics.median(b - a for a, b in zip(ends, ends[1:]))} if len(ends) > 1 else {},
        "train_reward": result["train_reward"], "save_s_total": result["save_s"],
    }


RACE_SETTINGS = ("seed", "minutes", "mark_minutes", "max_operand", "eval_tasks", "temperature", "lr", "max_tokens", "micro_batch")


PROBE_TOLERANCE = 0.10  # a TRL side is reused only on a machine within 10% of the speed it was raced at


def machine_probe(seconds: float = 5.0) -> float:
    """fp32 matmuls per second on this machine's threads, as the race's steps run them: the same code was 1.75x
    slower on one day than on the day before here (seed 0's loopline side gave the same scores at v1 and v2 at
    1.73-1.76x the minutes), so sides raced on different days are compared only where this agrees."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, b)
        done += 1
    return done / (time.perf_counter() - started)


def trl_side_from(raw: Path, args: argparse.Namespace, kept: Path, probe: float) -> dict:
    """TRL's side of an earlier race with the same settings on a machine as fast as this one, and its marks' scores
    (into `kept`, so they are not evaluated again: their checkpoints need not exist any more)."""
    earlier = json.loads(raw.read_text())
    if "probe" not in earlier or abs(probe / earlier["probe"] - 1) > PROBE_TOLERANCE:
        was = f"{earlier['probe']:.1f}" if "probe" in earlier else "not measured"
        raise SystemExit(f"{raw}: its machine ran {was} matmuls/s, this one {probe:.1f}: race TRL again here (--trl-python); "
                         "wall-clock from machines of different speeds does not compare")
    theirs = {**earlier["args"], "micro_batch": earlier["args"].get("micro_batch", earlier["args"].get("trl_micro_batch"))}
    differ = [k for k in RACE_SETTINGS if str(theirs.get(k)) != str(getattr(args, k))]
    if differ:
        raise SystemExit(f"{raw} was raced with other settings ({', '.join(f'{k} {theirs.get(k)} there, {getattr(args, k)} here' for k in differ)}): "
                         "race TRL again (--trl-python) or give those settings")
    side = earlier["sides"][-1]
    missing = [m["path"] for m in side["marks"] if m["path"] not in earlier.get("scores", {})]
    if side["side"] != "TRL" or missing:
        raise SystemExit(f"{raw}: its last side is not a TRL side with every mark evaluated ({len(missing)} not): report that race first (--report)")
    keep_scores(kept, {m["path"]: earlier["scores"][m["path"]] for m in side["marks"]}, args.eval_tasks, args.max_tokens)
    print(f"TRL: taken from {raw} (its marks' scores with it)", flush=True)
    return {**side, "from": str(raw)}


def kept_scores(kept: Path, eval_tasks: int, max_tokens: int) -> dict[str, float]:
    """The scores measured so far, where they were measured as now (the same held-out tasks and token limit)."""
    saved = json.loads(kept.read_text()) if kept.exists() else {}
    if saved and "scores" not in saved:  # (written before the settings were kept with the scores)
        return saved
    if saved and saved.get("measured") != {"eval_tasks": eval_tasks, "max_tokens": max_tokens}:
        raise SystemExit(f"{kept} holds scores measured otherwise ({saved.get('measured')}): move it away to measure again")
    return saved.get("scores", {})


def keep_scores(kept: Path, scores: dict[str, float], eval_tasks: int, max_tokens: int) -> None:
    kept.write_text(json.dumps({"measured": {"eval_tasks": eval_tasks, "max_tokens": max_tokens}, "scores": scores}, indent=1))


def evaluate(env: Path, paths: list[str], eval_tasks: int, max_tokens: int, kept: Path, temperature: float = 0.0) -> dict[str, float]:
    """Held-out success of each checkpoint: one harness, one engine kind, greedy, the same tasks and prompts. Each
    score is kept in `kept` as it is measured (a checkpoint takes minutes): an evaluation stopped part-way goes on
    from there (`--report`)."""
    import dataclasses

    from loopline.envregistry.spec import load_spec
    from loopline.envregistry.tasks import load_tasks
    from loopline.rollout.harness.actions import tool_schemas
    from loopline.rollout.harness.chat import ChatFormat
    from loopline.rollout.engines.base import SamplingParams
    from loopline.rollout.harness.episode import EpisodeSetup, run_episode
    from loopline.rollout.engines.local import LocalEngine

    spec = load_spec(env)
    held_out = [t for t in load_tasks(spec, env.parent) if t.split == "eval"][:eval_tasks]

    async def one(path: str) -> float:
        engine = LocalEngine(Path(path))
        chat = dataclasses.replace(ChatFormat.for_policy(Path(path)), few_shot=tuple(few_shot_turns())).with_tools(tool_schemas(spec.tools))
        setup = EpisodeSetup(spec, 0, chat, SamplingParams(temperature=temperature, max_new_tokens=max_tokens, seed=0))
        slots = asyncio.Semaphore(32)

        async def episode(task):
            async with slots:
                return await run_episode(engine, setup, task, f"race-eval-{task.id}")
        played = await asyncio.gather(*(episode(t) for t in held_out))
        await engine.close()
        return statistics.mean(p.reward == 1.0 for p in played)

    scores = kept_scores(kept, eval_tasks, max_tokens)
    for path in dict.fromkeys(paths):
        if path not in scores:
            scores[path] = asyncio.run(one(path))
            keep_scores(kept, scores, eval_tasks, max_tokens)
        print(f"  {path}: {scores[path]:.1%}", flush=True)
    return {path: scores[path] for path in paths}


def time_to(levels: dict[str, float], curve: list[tuple[float, float]]) -> dict[str, float | None]:
    """The first mark's training seconds at which the curve reaches each level (None: never within the race)."""
    return {name: next((t for t, success in curve if success >= level - 1e-9), None) for name, level in levels.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", help="python of TRL's venv (see this file's docstring)")
    parser.add_argument("--seed", type=int, default=0, help="both sides' seed (task order, sampling, initialisation of what is not loaded)")
    parser.add_argument("--combine", action="store_true", help="report every seed's raw file in the results directory together")
    parser.add_argument("--max-tokens", type=int, default=128, help="the model's tokens an episode (TRL's max_completion_length; see the docstring)")
    parser.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward, both sides (TRL's docs' memory "
                        "advice: small per-device batches and gradient accumulation making the same optimizer step; loopline: "
                        "micro_batch_tokens of as many rows of the prompt and --max-tokens)")
    parser.add_argument("--minutes", type=float, default=20.0, help="wall-clock each side trains")
    parser.add_argument("--mark-minutes", type=float, default=5.0)
    parser.add_argument("--max-operand", type=int, default=9999, help="the largest operand of a problem (the task's difficulty)")
    parser.add_argument("--modes", default="sync,async", help="loopline's modes to race (comma-separated)")
    parser.add_argument("--eval-tasks", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.7, help="rollout temperature, both sides")
    parser.add_argument("--lr", type=float, default=3e-6, help="both sides' constant learning rate (lower: more steps to climb)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where each seed's seed-S.{json,txt,png} and the combined report go")
    parser.add_argument("--report", type=Path, metavar="WORK", help="evaluate and report a finished race's work directory again")
    parser.add_argument("--trl-from", type=Path, metavar="RAW", help="a raw file (seed-S.json) of a race with the same settings: its TRL "
                        "side and that side's scores are taken, and only loopline's sides run (TRL's code is not loopline's: its side does not change with it)")
    parser.add_argument("--reuse", type=Path, metavar="WORK", help="a race's work directory whose loopline sides finished: read them "
                        "from their ledgers (each clock starts at its run config's writing, just before its process) and race TRL")
    args = parser.parse_args()
    if args.combine:
        return combine(args.results)
    out = args.results / f"seed-{args.seed}"
    if args.report:
        return finish(args.report, out)
    if not args.trl_python and not args.trl_from:
        parser.error("--trl-python is required to race (see this file's docstring for TRL's venv), or --trl-from RAW")
    seconds, mark_s = args.minutes * 60, args.mark_minutes * 60

    work = args.reuse or Path(tempfile.mkdtemp(prefix="loopline-race-"))
    probe = machine_probe()
    print(f"machine probe: {probe:.1f} fp32 1024x1024 matmuls/s", flush=True)
    trl = trl_side_from(args.trl_from, args, work / "scores.json", probe) if args.trl_from else None  # (checked before anything runs)
    model = work / "smollm2-tools-template" if args.reuse else prepare_model(work)
    env = write_env(work, args.eval_tasks, args.max_operand, args.max_tokens)
    from loopline.envregistry.spec import load_spec
    from loopline.envregistry.tasks import load_tasks

    train = [t for t in load_tasks(load_spec(env), env.parent) if t.split == "train"]
    same, prompt_tokens = check_same_prompt(model, env, train[0])
    print(same, flush=True)
    micro_batch_tokens = args.micro_batch * (prompt_tokens + args.max_tokens)
    sides = []
    for mode in args.modes.split(","):
        done = sorted(work.glob(f"race-{mode}-*.yaml")) if args.reuse else []
        if done:
            print(f"loopline {mode}: read from {done[-1].stem}'s ledger", flush=True)
            sides.append(loopline_side(done[-1].stem, mode, work / f"home-{mode}", done[-1].stat().st_mtime, model, seconds, mark_s))
            continue
        print(f"loopline {mode}: {args.minutes:g} min ...", flush=True)
        sides.append(race_loopline(model, env, mode, seconds, mark_s, work, args.temperature, args.seed, args.max_tokens, args.lr, micro_batch_tokens))
    if trl is not None:
        sides.append(trl)
    else:
        print(f"TRL: {args.minutes:g} min ...", flush=True)
        sides.append(race_trl(args.trl_python, model, train, seconds, mark_s, work, args.temperature, args.seed, args.max_tokens, args.micro_batch, args.lr))

    state = {"args": {k: str(v) for k, v in vars(args).items()}, "model": str(model), "env": str(env), "same": same,
             "eval_tasks": args.eval_tasks, "seed": args.seed, "header": f"seed {args.seed}: {args.minutes:g} min a side, marks every {args.mark_minutes:g} min, operands up to {args.max_operand}, T={args.temperature} rollouts, lr {args.lr:g}, 8x8 a step in micro-batches of {args.micro_batch} (loopline: {micro_batch_tokens} tokens), {args.max_tokens} tokens an episode",
             "sides": sides, "probe": probe, **({"trl_from": str(args.trl_from)} if args.trl_from else {})}
    (work / "race.json").write_text(json.dumps(state, indent=1))
    finish(work, out)


def finish(work: Path, out: Path) -> None:
    """Evaluate every mark's policy and write the results (`--report WORK` does it again for a finished race, or
    goes on with an evaluation that was stopped)."""
    state = json.loads((work / "race.json").read_text())
    sides, model = state["sides"], state["model"]
    print("evaluating every mark's policy ...", flush=True)
    eval_started = time.monotonic()
    # (TRL's, the last side, first: every other side is measured against its best)
    scores = evaluate(Path(state["env"]), [model] + [m["path"] for side in sides[::-1] for m in side["marks"]], state["eval_tasks"],
                      int(state["args"].get("max_tokens", 64)), work / "scores.json")
    text = report(sides, scores, model, f"race_vs_trl: {state['header']}, {state['eval_tasks']} held-out tasks (greedy); {state['same']}; "
                  f"evaluation {time.monotonic() - eval_started:.0f} s (off every clock)")
    print("\n" + text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({**state, "scores": scores}, indent=1))
    plot(sides, out.with_suffix(".png"), f"SmolLM2-135M, arithmetic with a calc tool, {state['eval_tasks']} held-out (greedy)")
    print(f"(work directory {work}; results {out}.txt/.json/.png)")


def report(sides: list[dict], scores: dict[str, float], base_path: str, header: str) -> str:
    """The table: success at each mark, time to each level and the ratio to TRL's (the last side), memory, where
    the time went. Adds each side's `curve`, `best` and `time_to`."""
    base = scores[base_path]
    levels = {"base+5": base + 0.05, "base+10": base + 0.10, "base+15": base + 0.15}
    for side in sides:
        side["curve"] = [(0.0, base)] + [(m["trained_s"], scores[m["path"]]) for m in side["marks"]]
        side["best"] = max(s for _, s in side["curve"])
    levels["TRL's best"] = sides[-1]["best"]
    for side in sides:
        side["time_to"] = time_to(levels, side["curve"])
    lines = [header, f"{'held-out success at mark':28s}" + "".join(f"{s['side']:>18s}" for s in sides),
             f"{'  start':28s}" + "".join(f"{base:18.1%}" for _ in sides)]
    for k in range(max(len(s["marks"]) for s in sides)):
        cells = []
        for side in sides:
            mark = side["marks"][k] if k < len(side["marks"]) else None
            cells.append(f"{scores[mark['path']]:.1%} ({mark['trained_s'] / 60:.1f}m)" if mark else "-")
        lines.append(f"{'  mark ' + str(k + 1):28s}" + "".join(f"{c:>18s}" for c in cells))
    lines.append(f"{'best':28s}" + "".join(f"{s['best']:18.1%}" for s in sides))
    for level in levels:
        cells = [s["time_to"][level] for s in sides]
        ratios = [f"{c / cells[-1]:.2f}x" if c is not None and cells[-1] else "-" for c in cells[:-1]]
        lines.append(f"{'minutes to ' + level:28s}" + "".join(f"{c / 60:18.1f}" if c is not None else f"{'never':>18s}" for c in cells)
                     + f"   loopline/TRL: {', '.join(ratios)}")
    lines.append(f"{'steps in the budget':28s}" + "".join(f"{s['steps_in_budget']:18d}" for s in sides))
    peaks = [s["memory"]["peak_gib"] for s in sides]
    lines.append(f"{'peak memory, summed (GiB)':28s}" + "".join(f"{m:18.2f}" for m in peaks)
                 + "   loopline/TRL: " + ", ".join(f"{m / peaks[-1]:.2f}x" for m in peaks[:-1]))
    for side in sides:
        if side["memory"].get("at_peak_gib"):
            lines.append(f"{side['side']}: at the peak (GiB) " + ", ".join(f"{k} {v:.2f}" for k, v in list(side["memory"]["at_peak_gib"].items())[:5]))
    for side in sides:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in side["median_step"].items()) or "fewer than 2 steps"
        lines.append(f"{side['side']}: median step (s) {parts}" + (f"; startup ~{side['startup_s']:.0f} s" if side.get("startup_s") else ""))
    return "\n".join(lines)


def combine(results: Path) -> None:
    """Every seed's raw file (`seed-S.json`) reported together: for each side the median over seeds and the
    range of the time to TRL's best (and its ratio to TRL's in the same seed), of the best held-out success and of
    the summed peak memory; one plot with every seed's curve. Writes `combined.{txt,png}` beside them."""
    races = [json.loads(path.read_text()) for path in sorted(results.glob("seed-*.json"))]
    if not races:
        raise SystemExit(f"no seed-*.json in {results}: run a race with --seed first")
    names = [side["side"] for side in races[0]["sides"]]
    lines = [f"race_vs_trl, {len(races)} seed(s) ({', '.join(str(r['seed']) for r in races)}): median [min, max] over seeds; "
             f"{races[0]['header'].split(': ', 1)[-1]}, {races[0]['eval_tasks']} held-out tasks"]

    def spread(values: list[float | None], unit: str = "", digits: int = 2, missing: str = "never") -> str:
        if any(v is None for v in values):
            return f"{missing} in {sum(v is None for v in values)} of {len(values)} seeds"
        return f"{statistics.median(values):.{digits}f}{unit} [{min(values):.{digits}f}, {max(values):.{digits}f}]"

    for name in names:
        sides = [next(s for s in race["sides"] if s["side"] == name) for race in races]
        trl = [race["sides"][-1] for race in races]
        to_best = [s["time_to"]["TRL's best"] for s in sides]
        ratios = [None if a is None or not b["time_to"]["TRL's best"] else a / b["time_to"]["TRL's best"] for a, b in zip(to_best, trl)]
        memory = [s["memory"]["peak_gib"] for s in sides]
        lines += [f"{name}:",
                  f"  minutes to TRL's best   {spread([None if t is None else t / 60 for t in to_best], ' min', 1)}"
                  + ("" if name == "TRL" else f"   loopline/TRL {spread(ratios, 'x', missing='no ratio (a side never, or TRL at 0)')}"),
                  f"  best held-out success   {spread([100 * s['best'] for s in sides], '%', 1)}",
                  f"  peak memory, summed     {spread(memory, ' GiB')}"
                  + ("" if name == "TRL" else f"   loopline/TRL {spread([m / t['memory']['peak_gib'] for m, t in zip(memory, trl)], 'x')}"),
                  f"  steps in the budget     {spread([s['steps_in_budget'] for s in sides], '', 0)}",
                  f"  startup                 {spread([s.get('startup_s') for s in sides], ' s', 0, missing='no step')}"]
    text = "\n".join(lines)
    print(text)
    (results / "combined.txt").write_text(text + "\n")
    plot([side | {"side": f"{side['side']} (seed {race['seed']})"} for race in races for side in race["sides"]],
         results / "combined.png", f"SmolLM2-135M, arithmetic with a calc tool, {races[0]['eval_tasks']} held-out (greedy), {len(races)} seeds")


def plot(sides: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    colours: dict[str, str] = {}  # one colour a side, whatever its seed
    for side in sides:
        colour = colours.setdefault(side["side"].split(" (seed")[0], f"C{len(colours)}")
        axes.plot([t / 60 for t, _ in side["curve"]], [100 * s for _, s in side["curve"]], marker="o", label=side["side"], color=colour)
    axes.set_xlabel("training wall-clock (minutes, evaluation and saves excluded)")
    axes.set_ylabel("held-out success (%)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
