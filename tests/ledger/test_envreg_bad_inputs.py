"""Hostile and mistaken environment files: `envreg add` answers each with one line, fast, registering nothing.

Each case is run as a user runs it (`envreg add FILE` in a subprocess against a real, empty ledger) and
must exit 1 with exactly one line on stderr that names the problem, no traceback, and within 300 MB of
memory; afterwards the ledger holds no environment at all. Time is bounded at 30 s per case: what this
guards against is minutes (billion laughs, huge generators, endless loops). Measured alone, every case
answers in under 4 s, most of it interpreter start (~1.5 s); a tighter bound flaked on this shared machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa

from loopline.store.db import make_engine
from loopline.store.migrate import upgrade
from tests.conftest import create_scratch_database, drop_scratch_database

JSONL = """\
name: bad
sandbox: {backend: local}
tasks: {kind: jsonl, path: tasks.jsonl}
verifier: {builtin: arithmetic_answer}
"""
GEN = """\
name: bad
sandbox: {backend: local}
tasks: {kind: generator, generator: arithmetic, train_size: 50, eval_size: 10}
verifier: {builtin: arithmetic_answer}
"""
CMD = """\
name: bad
sandbox: {backend: docker, image: loopline-python:bookworm}
tasks: {kind: jsonl, path: tasks.jsonl}
tools:
  - name: run
    description: run a command
    args: {cmd: {type: string}}
    command: "sh -c {cmd}"
verifier:
  command: python3 check.py
  support_files: {check.py: "print(1)"}
"""


def row(i: int, split: str = "train", **extra) -> dict:
    return {"id": f"t{i}", "split": split, "prompt": f"What is {i} + 1?", "expression": f"{i} + 1", "answer": i + 1, **extra}


ROWS = [row(1), row(2), row(3, "eval")]


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# name -> (spec text or bytes, task file text or bytes or None, a substring the error must contain)
CASES: dict[str, tuple[str | bytes, str | bytes | None, str]] = {
    # --- bounded inputs
    "billion_laughs": (GEN + 'l0: &l0 "lol"\n' + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10)), None, "expands to more than"),
    "yaml_of_5_mb": (GEN + "description: " + "x" * (5 << 20) + "\n", None, "may be at most"),
    "flow_nesting_5000_deep": (GEN + "description: " + "[" * 5000 + "]" * 5000 + "\n", None, "nested"),
    "mapping_nesting_60_deep": (GEN + "description: " + "{a: " * 60 + "1" + "}" * 60 + "\n", None, "nested deeper than"),
    "long_flat_list": (GEN + "description: [" + ", ".join(["1"] * 30000) + "]\n", None, "more than 10,000 values"),
    "train_size_a_billion": (GEN.replace("train_size: 50", "train_size: 1000000000"), None, "less than or equal to 100000"),
    "seed_of_5000_digits": (GEN.replace("eval_size: 10", "eval_size: 10, seed: " + "9" * 5000), None, "a number of 5,000 digits"),
    "train_size_1e9": (GEN.replace("train_size: 50", "train_size: 1e9"), None, "tasks.train_size"),
    "max_operand_1_cannot_hold_out": (GEN.replace("eval_size: 10", "eval_size: 10, params: {max_operand: 1, split: problems}"), None, "held-out problems could be drawn"),
    "unknown_generator_param": (GEN.replace("eval_size: 10", "eval_size: 10, params: {colour: red}"), None, "tasks.params.colour"),
    "bad_split_rule": (GEN.replace("eval_size: 10", "eval_size: 10, params: {split: random}"), None, "tasks.params.split"),
    "eval_min_operand_above_max": (GEN.replace("eval_size: 10", "eval_size: 10, params: {split: operands, max_operand: 50, eval_min_operand: 80}"), None, "must be <= max_operand"),
    "task_file_of_65_mb": (JSONL, jsonl(ROWS) + " " * (65 << 20) + "\n", "may be at most"),
    "task_row_nested_100000_deep": (JSONL, jsonl(ROWS) + "[" * 100000 + "]" * 100000 + "\n", "tasks.jsonl:4"),
    # --- validate must mean add works (what the database would refuse)
    "nan_in_task_data": (JSONL, jsonl(ROWS).replace('"answer": 2', '"answer": NaN'), "not a JSON number"),
    "infinity_in_task_data": (JSONL, jsonl(ROWS).replace('"answer": 2', '"answer": Infinity'), "not a JSON number"),
    "nul_in_task_data": (JSONL, jsonl([*ROWS, row(4, note="a\u0000b")]), "NUL character"),
    "inf_in_spec": (GEN + "budgets: {wall_time_s: .inf}\n", None, "budgets.wall_time_s"),
    "nan_in_spec": (GEN.replace("backend: local}", "backend: local, resources: {cpus: .nan}}"), None, "sandbox.resources.cpus"),
    "null_prompt": (JSONL, jsonl([*ROWS, {**row(4), "prompt": None}]), "prompt must be a non-empty string"),
    "dict_as_task_id": (JSONL, jsonl([*ROWS, {**row(4), "id": {"x": 1}}]), "id must be"),
    "smoke_test_uses_missing_task_field": (GEN + "smoke_test: {steps: [{answer: '{task.no_such_field}'}]}\n", None, "'no_such_field'"),
    "reset_file_from_missing_task_field": (JSONL + "reset: {files: {notes.txt: notes}}\n", jsonl(ROWS), "'notes'"),
    "builtin_verifier_without_its_fields": (JSONL, jsonl([{"id": "a", "split": "train", "prompt": "p"}, {"id": "b", "split": "eval", "prompt": "q"}]), "'expression'"),
    "expect_reward_outside_range": (GEN + "smoke_test: {steps: [{answer: x}], expect_reward: 5}\n", None, "reward_range"),
    "tool_named_answer": (GEN + "tools: [{name: answer, description: d, builtin: calculator}]\n", None, "reserved"),
    "awk_braces_in_command": (CMD.replace("sh -c {cmd}", "awk '{print $1}' {cmd}"), jsonl(ROWS), "literal brace"),
    "unclosed_brace_in_command": (CMD.replace("sh -c {cmd}", "sh -c {cmd"), jsonl(ROWS), "literal brace"),
    "cpu_quota_on_local_backend": (GEN.replace("backend: local}", "backend: local, resources: {cpus: 2}}"), None, "cannot enforce resources.cpus"),
    "network_on_local_backend": (GEN.replace("backend: local}", "backend: local, network: true}"), None, "unsafe_host"),
    "unsafe_host_on_docker": (CMD.replace("image: loopline-python:bookworm}", "image: loopline-python:bookworm, unsafe_host: true}"), jsonl(ROWS), "sandbox.unsafe_host: not a setting of this backend; it is local's"),
    "memory_1e20": (CMD.replace("image: loopline-python:bookworm}", "image: loopline-python:bookworm, resources: {memory_mb: 1e20}}"), jsonl(ROWS), "sandbox.resources.memory_mb"),
    "memory_beyond_a_tebibyte": (CMD.replace("image: loopline-python:bookworm}", "image: loopline-python:bookworm, resources: {memory_mb: 100000000000000000000}}"), jsonl(ROWS), "less than or equal"),
    "absolute_hidden_file_path": (CMD + "  hidden_files: {/tmp/tests.py: answer}\n", jsonl(ROWS), "relative path"),
    "dotdot_reset_file_path": (JSONL + "reset: {files: {../x.txt: answer}}\n", jsonl(ROWS), "relative path"),
    "verifier_file_named_verdict": (CMD.replace("{check.py:", "{verdict.json:"), jsonl(ROWS), "written by the verifier run itself"),
    "verifier_file_named_dot_slash_verdict": (CMD.replace("{check.py:", "{./verdict.json:"), jsonl(ROWS), "written by the verifier run itself"),
    # a placeholder's value is quoted by loopline: inside quotes (x = $(touch MARKER)) it would run
    "placeholder_in_double_quotes": (CMD.replace("sh -c {cmd}", 'echo \\"{cmd}\\"'), jsonl(ROWS), "is inside quotes"),
    "placeholder_in_single_quotes": (CMD.replace("sh -c {cmd}", "echo '{cmd}'"), jsonl(ROWS), "is inside quotes"),
    # ... and in shell arithmetic or a here-document, where `$(...)` in it runs too
    "placeholder_in_shell_arithmetic": (CMD.replace("sh -c {cmd}", "echo $(( {cmd} + 1 ))"), jsonl(ROWS), "inside shell arithmetic"),
    "placeholder_in_a_here_document": (CMD.replace('"sh -c {cmd}"', '"cat <<EOF\\n{cmd}\\nEOF"'), jsonl(ROWS), "inside a here-document"),
    "placeholder_with_a_conversion": (CMD.replace("sh -c {cmd}", "sh -c {cmd!r}"), jsonl(ROWS), "without a conversion or format spec"),
    "placeholder_with_a_huge_format_spec": (CMD.replace("sh -c {cmd}", "sh -c {cmd:>400000000}"), jsonl(ROWS), "without a conversion or format spec"),
    "workdir_is_the_verifiers": (CMD.replace("image: loopline-python:bookworm}", "image: loopline-python:bookworm, workdir: /verify}"), jsonl(ROWS), "which the sandbox reserves"),
    "relative_workdir": (CMD.replace("image: loopline-python:bookworm}", "image: loopline-python:bookworm, workdir: work}"), jsonl(ROWS), "must be an absolute path"),
    "tool_argument_named_0": (CMD.replace("args: {cmd: {type: string}}", "args: {'0': {type: string}}").replace("sh -c {cmd}", "sh -c {0}"), jsonl(ROWS), "is not a name"),
    "task_file_that_never_ends": (JSONL.replace("path: tasks.jsonl", "path: /proc/self/mem"), None, "must be a regular file"),
    "a_ten_thousandth_of_a_cpu": (CMD.replace("image: loopline-python:bookworm}", "image: loopline-python:bookworm, resources: {cpus: 0.0001}}"), jsonl(ROWS), "sandbox.resources.cpus"),
    "reward_range_reversed": (CMD + "  reward_range: [1, 0]\n", jsonl(ROWS), "low < high"),
    "timeout_of_a_billion_seconds": (CMD + "  timeout_s: 1e9\n", jsonl(ROWS), "verifier.timeout_s"),
    "both_builtin_and_command_verifier": (GEN.replace("{builtin: arithmetic_answer}", "{builtin: arithmetic_answer, command: x}"), None, "exactly one"),
    # --- one-line errors for what used to be tracebacks or eaten markup
    "not_utf8_spec": (GEN.encode() + b"description: caf\xe9\n", None, "not UTF-8"),
    "not_utf8_task_file": (JSONL, jsonl(ROWS).encode() + b'{"id": "x\xff"}\n', "not UTF-8"),
    "nul_in_spec": (GEN + "description: a\x00b\n", None, "NUL character"),
    "markup_like_name": (GEN.replace("name: bad", "name: '[bold]X[/bold]'"), None, "^[a-z][a-z0-9_\\-]{0,62}$"),
    "duplicate_key": (GEN + "name: other\n", None, "duplicate key 'name'"),
    "top_level_list": ("- name: bad\n", None, "expected a mapping"),
    "empty_file": ("", None, "expected a mapping"),
    "tab_indentation": ("name: bad\nsandbox:\n\tbackend: local\n", None, "not valid YAML"),
    "missing_task_file": (JSONL, None, "task file not found"),
    "task_row_not_an_object": (JSONL, jsonl(ROWS) + "[1, 2]\n", "must be a JSON object"),
    "duplicate_task_id": (JSONL, jsonl([*ROWS, row(1)]), "duplicate task id"),
    "eval_repeats_a_train_prompt": (JSONL, jsonl([*ROWS, {**row(9, "eval"), "prompt": "What is 1 + 1?"}]), "repeat train prompts"),
    "no_eval_tasks": (JSONL, jsonl(ROWS[:2]), "at least one train and one eval"),
    "smoke_test_uses_undeclared_tool": (GEN + "smoke_test: {steps: [{tool: shell}]}\n", None, "not declared"),
}


@pytest.fixture(scope="module")
def empty_ledger():
    url = create_scratch_database("loopline_badinput")
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    yield url
    drop_scratch_database(url)


def _add(url: str, case: str) -> dict:
    spec, tasks, _ = CASES[case]
    folder = Path(tempfile.mkdtemp(prefix=f"badinput-{case}-"))
    spec_file = folder / "env.yaml"
    spec_file.write_bytes(spec if isinstance(spec, bytes) else spec.encode())
    if tasks is not None:
        (folder / "tasks.jsonl").write_bytes(tasks if isinstance(tasks, bytes) else tasks.encode())
    env = {**os.environ, "LOOPLINE_DATABASE_URL": url, "COLUMNS": "300"}
    env.pop("LOOPLINE_DEBUG", None)
    # The child's own peak memory (VmHWM of its post-exec address space: rusage would include this
    # process's size, carried over by fork/exec), written when it exits.
    status_file = folder / "status"
    report = f"import atexit; atexit.register(lambda: open({str(status_file)!r}, 'w').write(open('/proc/self/status').read()))"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", f"{report}\nfrom loopline.envreg import app; app()", "add", str(spec_file)],
        capture_output=True, text=True, env=env, timeout=60,
    )
    seconds = time.monotonic() - start
    peak_kb = next(int(line.split()[1]) for line in status_file.read_text().splitlines() if line.startswith("VmHWM:"))
    return {"code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "seconds": seconds, "rss_mb": peak_kb / 1024}


def test_at_least_forty_bad_inputs():
    assert len(CASES) >= 40


def test_each_bad_input_is_one_line_fast_and_registers_nothing(empty_ledger):
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(CASES, pool.map(lambda case: _add(empty_ledger, case), CASES)))
    problems = []
    for case, got in results.items():
        lines = got["stderr"].strip().splitlines()
        expected = CASES[case][2]
        if got["code"] != 1 or len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in got["stderr"]:
            problems.append(f"{case}: exit {got['code']}, stderr {got['stderr'][-400:]!r}, stdout {got['stdout'][-200:]!r}")
        elif expected not in lines[0]:
            problems.append(f"{case}: {expected!r} not in {lines[0]!r}")
        elif got["seconds"] > 30 or got["rss_mb"] > 300:
            problems.append(f"{case}: {got['seconds']:.1f} s, {got['rss_mb']:.0f} MB")
    assert not problems, "\n".join(problems)
    engine = make_engine(empty_ledger)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM environment")).scalar_one() == 0
    engine.dispose()
