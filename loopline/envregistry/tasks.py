"""Task sources: a built-in generator or a JSONL file; train and eval never overlap."""

from __future__ import annotations

import hashlib
import json
import operator
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loopline.envregistry.spec import EnvSpec, GeneratorTasks, JsonlTasks, read_text
from loopline.errors import LooplineError
from loopline.types import Split


@dataclass(frozen=True)
class Task:
    """`prompt` is shown to the agent; `data` (answers, hidden tests) is only for reset and the verifier."""

    id: str
    split: Split
    prompt: str
    data: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- arithmetic generator

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
TEMPLATES = ("a o b", "a o b o c", "(a o b) o c", "a o (b o c)")
# split: templates -> train and eval use disjoint templates (eval needs a form never seen in training);
# split: operands  -> the same templates, but every eval problem has an operand >= eval_min_operand and
#                     no train operand reaches it (eval is harder numbers, never a seen problem);
# split: problems  -> one distribution for both; an eval problem never appears in train (held-out problems).
TRAIN_TEMPLATES = ("a o b", "a o b o c", "(a o b) o c")
EVAL_TEMPLATES = ("a o (b o c)",)


def _apply(template: str, nums: list[int], ops: list[str]) -> tuple[str, int]:
    """Render and compute one problem from its parts (no string evaluation anywhere)."""
    a, b, *rest = nums
    f = [_OPS[o] for o in ops]
    if template == "a o b":
        return f"{a} {ops[0]} {b}", f[0](a, b)
    c = rest[0]
    if template == "(a o b) o c":
        return f"({a} {ops[0]} {b}) {ops[1]} {c}", f[1](f[0](a, b), c)
    if template == "a o (b o c)":
        return f"{a} {ops[0]} ({b} {ops[1]} {c})", f[0](a, f[1](b, c))
    # "a o b o c": usual precedence, * binds tighter
    if ops[1] == "*" and ops[0] != "*":
        return f"{a} {ops[0]} {b} {ops[1]} {c}", f[0](a, f[1](b, c))
    return f"{a} {ops[0]} {b} {ops[1]} {c}", f[1](f[0](a, b), c)


def arithmetic_tasks(source: GeneratorTasks) -> list[Task]:
    params = source.params
    max_operand, split_rule, threshold = params.max_operand, params.split, params.eval_min_operand
    tasks = []
    seen: set[str] = set()
    for split, size in (("train", source.train_size), ("eval", source.eval_size)):
        templates = TRAIN_TEMPLATES if split == "train" else EVAL_TEMPLATES
        if split_rule != "templates":
            templates = TEMPLATES
        rng = random.Random(f"{source.seed}/{split}")
        i, draws = 0, 0
        while i < size:
            draws += 1
            if draws > 20 * size + 10_000:  # held-out problems can run out when operands are few
                raise LooplineError(
                    f"tasks: only {i} of eval_size={size} held-out problems could be drawn that never occur in "
                    f"train with max_operand={max_operand}; lower eval_size/train_size or raise max_operand"
                )
            template = templates[i % len(templates)]
            n = 2 if template == "a o b" else 3
            if split_rule in ("templates", "problems"):
                nums = [rng.randint(1, max_operand) for _ in range(n)]
            elif split == "train":
                nums = [rng.randint(1, threshold - 1) for _ in range(n)]
            else:  # at least one operand at or above the threshold
                nums = [rng.randint(1, max_operand) for _ in range(n)]
                nums[rng.randrange(n)] = rng.randint(threshold, max_operand)
            ops = [rng.choice(list(_OPS)) for _ in range(n - 1)]
            expression, answer = _apply(template, nums, ops)
            if split_rule == "problems" and split == "eval" and expression in seen:
                continue  # held out means never trained on
            seen.add(expression)
            tasks.append(
                Task(
                    f"arith-{split}-{i:05d}",
                    split,
                    f"What is {expression}?",
                    {"expression": expression, "answer": answer, "template": template},
                )
            )
            i += 1
    return tasks


# --------------------------------------------------------------------------- JSONL


def jsonl_path(source: JsonlTasks, base_dir: Path) -> Path:
    return (base_dir / source.path).resolve()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


MAX_TASK_FILE_BYTES = 64 << 20  # 64 MiB: the rows are stored with the environment version in the ledger
MAX_TASKS = 100_000


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def jsonl_tasks(path: Path) -> list[Task]:
    if not path.is_file():
        raise LooplineError(f"{path}: task file not found (tasks.path is relative to the YAML file)")
    text = read_text(path, MAX_TASK_FILE_BYTES, "a task file")
    tasks, seen = [], {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line, parse_constant=_no_constant)
        except RecursionError:
            raise LooplineError(f"{where}: nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, NaN / Infinity
            raise LooplineError(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
        if not isinstance(row, dict):
            raise LooplineError(f"{where}: each line must be a JSON object with id, split, prompt")
        missing = [k for k in ("id", "split", "prompt") if k not in row]
        if missing:
            raise LooplineError(f"{where}: missing field(s) {', '.join(missing)}")
        if row["split"] not in ("train", "eval"):
            raise LooplineError(f"{where}: split must be 'train' or 'eval', not {row['split']!r}")
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise LooplineError(f"{where}: prompt must be a non-empty string, not {row['prompt']!r}")
        if not isinstance(row["id"], (str, int)) or isinstance(row["id"], bool) or not str(row["id"]):
            raise LooplineError(f"{where}: id must be a non-empty string or an integer, not {row['id']!r}")
        if len(tasks) >= MAX_TASKS:
            raise LooplineError(f"{where}: more than {MAX_TASKS:,} tasks in one file")
        task_id = str(row["id"])
        if task_id in seen:
            raise LooplineError(f"{where}: duplicate task id {task_id!r} (first on line {seen[task_id]})")
        seen[task_id] = lineno
        data = {k: v for k, v in row.items() if k not in ("id", "split", "prompt")}
        tasks.append(Task(task_id, row["split"], str(row["prompt"]), data))
    check_disjoint(tasks, str(path))
    return tasks


def check_disjoint(tasks: list[Task], where: str) -> None:
    """No prompt may be both a train and an eval task: eval must measure generalisation."""
    train = {t.prompt for t in tasks if t.split == "train"}
    overlap = sorted(t.id for t in tasks if t.split == "eval" and t.prompt in train)
    if overlap:
        raise LooplineError(f"{where}: eval tasks {', '.join(overlap[:5])} repeat train prompts; splits must not overlap")
    if not train or not any(t.split == "eval" for t in tasks):
        raise LooplineError(f"{where}: needs at least one train and one eval task")


def check_fields(spec: EnvSpec, tasks: list[Task]) -> None:
    """Every task field the spec refers to exists on every task: known now, not at the first episode."""
    for name, where in spec.task_fields().items():
        lacking = [t.id for t in tasks if name not in t.data]
        if lacking:
            raise LooplineError(
                f"{where} uses task field {name!r}, which task {lacking[0]!r}"
                + (f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else "")
                + f" does not have; task fields: {', '.join(sorted({k for t in tasks for k in t.data})) or 'none'}"
            )


def load_tasks(spec: EnvSpec, base_dir: Path) -> list[Task]:
    source = spec.tasks
    if isinstance(source, GeneratorTasks):
        tasks = arithmetic_tasks(source)
        check_disjoint(tasks, f"generator {source.generator}")
    else:
        tasks = jsonl_tasks(jsonl_path(source, base_dir))
    check_fields(spec, tasks)
    return tasks
