"""Small environment files for tests: a JSONL-task spec on the local backend and its rows."""

from __future__ import annotations

import json
from pathlib import Path

JSONL_SPEC = """\
name: {name}
sandbox:
  backend: local
tasks:
  kind: jsonl
  path: tasks.jsonl
tools:
  - name: run
    description: run a shell command
    args: {{cmd: {{type: string}}}}
    command: "{{cmd}}"
verifier:
  command: "echo '{{\\"passed\\": 1, \\"total\\": 1}}' > verdict.json"
"""


def write_env(tmp_path: Path, name: str, rows: list[dict], extra: str = "") -> Path:
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    path = tmp_path / "env.yaml"
    path.write_text(JSONL_SPEC.format(name=name) + extra)
    return path


ROWS = [
    {"id": "a", "split": "train", "prompt": "p1"},
    {"id": "b", "split": "eval", "prompt": "p2"},
]
