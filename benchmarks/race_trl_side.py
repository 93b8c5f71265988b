"""TRL's side of `benchmarks/race_vs_trl.py`, run by the Python of TRL's own virtual environment (it imports
no loopline). GRPO for a tool-using agent as TRL's docs show it: `GRPOTrainer(tools=[calc])`, conversational
prompts, the tool's calls parsed by the chat template's response schema and answered by TRL's own loop.

It trains for a budget of wall-clock seconds and saves the policy after every step; the time a save takes is
kept off the clock (the other side's exports are off its clock too). Writes OUT/steps.json: each step's
checkpoint directory and seconds trained, the training rewards, the startup (the caller measures the memory of the
whole process tree)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

STARTED = time.monotonic()  # (the clock starts with the process, imports included, as a user's does)

from transformers import TrainerCallback  # noqa: E402

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")  # the env's verifier: the last answer of the final message


def reward(completions, answer, **_) -> list[float]:
    scores = []
    for messages, expected in zip(completions, answer):
        final = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
        found = ANSWER.findall(final or "")
        scores.append(float(bool(found) and int(found[-1]) == int(expected)))
    return scores


def as_trl_tool(function):
    """The env's tool as TRL is given it: the same function and docstring, its return type unannotated, so
    that the schema the template shows is the one the other side shows (transformers adds `return` otherwise)."""

    def tool(expression: str):
        return function(expression)

    tool.__name__, tool.__doc__ = function.__name__, function.__doc__
    return tool


class Saves(TrainerCallback):
    """Saves the policy after every step (the caller picks, for each mark, the newest step that ended before it:
    the rule the other side's versions follow) and stops at the first step end past the budget; saving is off
    the clock."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s = out, budget_s
        self.paused = 0.0  # seconds spent saving
        self.steps: list[dict] = []
        self.trainer = None
        self.startup_s: float | None = None  # process start to training start: imports, model load, the trainer

    def on_train_begin(self, args, state, control, **_):
        self.startup_s = time.monotonic() - STARTED
        return control

    def on_step_end(self, args, state, control, **_):
        now = time.monotonic() - STARTED - self.paused
        began = time.monotonic()
        directory = self.out / f"step-{state.global_step}"
        self.trainer.save_model(str(directory))
        self.steps.append({"step": state.global_step, "trained_s": now, "path": str(directory)})
        self.paused += time.monotonic() - began
        if now >= self.budget_s:
            control.should_training_stop = True
        return control


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSONL: messages (system, worked examples, question) and answer")
    parser.add_argument("--tool-module", required=True, help="directory holding calc_tool.py (the env's calculator)")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--budget-s", type=float, required=True)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-tool-calls", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward (TRL's per_device_train_batch_size)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    sys.path.insert(0, args.tool_module)
    from calc_tool import calc

    rows = [json.loads(line) for line in open(args.prompts)]
    data = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])
    saves = Saves(args.out, args.budget_s)
    config = GRPOConfig(
        # one generation of groups x group_size completions, then one optimizer step over them in micro-batches
        output_dir=str(args.out / "trainer"), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.groups * args.group_size // args.micro_batch, num_generations=args.group_size, max_completion_length=args.max_new_tokens,
        max_tool_calling_iterations=args.max_tool_calls, temperature=args.temperature, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        loss_type="dapo", num_iterations=1, epsilon=0.2, epsilon_high=0.28, beta=0.0, scale_rewards="group",
        use_vllm=False, max_steps=100_000, logging_steps=1, save_strategy="no", report_to=[], bf16=False,
        use_cpu=True, seed=args.seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if getattr(tokenizer, "response_template", None) is None:  # (a template TRL does not know: its tool calls are
        tokenizer.response_template = qwen3_template  # `<tool_call>` JSON blocks, as its Qwen templates')
    trainer = GRPOTrainer(model=args.model, processing_class=tokenizer, reward_funcs=reward, args=config, train_dataset=data,
                          tools=[as_trl_tool(calc)], callbacks=[saves])
    saves.trainer = trainer
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    (args.out / "steps.json").write_text(json.dumps({
        "steps": saves.steps, "train_reward": rewards, "save_s": saves.paused, "startup_s": saves.startup_s,
    }, indent=1))


if __name__ == "__main__":
    main()
