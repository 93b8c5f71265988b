"""The layering DESIGN.md states, checked on the source: every module has a layer, nothing imports upward, no
module imports itself back through others (not even from inside a function), SQL lives in `store/`, Prefect
only in `tasks/` and `flows/`. The docs' layer page is generated from ALLOWED and NEUTRAL."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "loopline"
# importable from every layer (`types`: the RL vocabulary the rollout records, the ledger stores, the trainer reads)
NEUTRAL = {"errors", "holder", "failpoints", "ports", "aio", "stop_signals", "types", "yamlfile", "metrics", "activity", "registry", "plugins", "envvars", "allocator"}
# the command lines, above every layer (nothing below may import them)
TOP = {"cli", "envreg", "cli_support", "cli_progress", "entry", "__init__"}
# layer -> the layers it may import (besides itself and the neutral modules)
ALLOWED = {
    "store": set(),
    "migrations": {"store"},
    "envregistry": {"store"},
    "rollout": {"store", "envregistry"},
    "trainer": set(),  # (its records are `loopline.types`; the tasks load them from the ledger)
    "plan": set(),  # memory before launch: arithmetic on a model's shape and a run's workload
    "config": {"rollout", "trainer"},  # the run config: its sections name their engines and learner settings
    # where a run's starting policy comes from: model directories, pulls, the tiny starter's builder
    "policies": {"store", "envregistry", "rollout", "trainer", "plan"},
    # the experiment trackers: projections of the ledger's metrics
    "tracking": {"store", "config"},
    # the loop's plain code: its stages, the learner's side, opening and assembling a run (no Prefect)
    "pipeline": {"store", "envregistry", "rollout", "trainer", "config", "plan", "policies"},
    "tasks": {"store", "envregistry", "rollout", "trainer", "config", "pipeline"},
    "flows": {"store", "envregistry", "rollout", "trainer", "tasks", "config", "plan", "pipeline", "tracking"},
    # the Prefect server, deployments and work pools, a launched learner rank's entry point
    "orchestration": {"store", "config", "trainer", "pipeline", "flows"},
    # The inspector reads the store; it also shows specs and diffs with the registry's pure helpers.
    # Advantages come from the store as the learner used them (never recomputed with the trainer's code).
    "ui": {"store", "envregistry"},
}
SQL = re.compile(r"\b(SELECT .* FROM|INSERT INTO|UPDATE \w+ SET|DELETE FROM)\b|exec_driver_sql|sa\.text\(|sa\.select\(|sa\.update\(")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        yield path, parts[0].removesuffix(".py")


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path) for path, _ in _modules()}


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function; `from loopline.x import y` names the module
    `loopline.x.y` when y is one (else `loopline.x`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_every_module_has_a_layer():
    """A module outside the table would escape the layer check (its imports, and who imports it)."""
    layers = set(ALLOWED) | NEUTRAL | TOP
    assert not {layer for _, layer in _modules()} - layers, "add it to ALLOWED, NEUTRAL or TOP"


def test_nothing_imports_upward():
    wrong = []
    for path, layer in _modules():
        if layer not in ALLOWED:
            continue  # the command lines sit on top of everything
        for module in _imports(path):
            if module.startswith("loopline."):
                target = module.split(".")[1]
                if target != layer and target not in NEUTRAL and target not in ALLOWED[layer]:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_no_import_circles():
    """Modules that import each other, directly or round a longer loop, even from inside a function (a local
    import that only defers the circle hides it): each circle found (Tarjan's strongly connected components)."""
    graph = {_name(path): {m for m in _imports(path) if m in MODULES} - {_name(path)} for path, _ in _modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_no_sql_outside_the_store():
    wrong = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path, layer in _modules()
        if layer not in ("store", "migrations")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SQL.search(line)
    ]
    assert not wrong, "\n".join(wrong)


def test_prefect_only_in_tasks_and_flows():
    """(and in orchestration/, which runs Prefect's server and registers the flows)"""
    wrong = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path, layer in _modules()
        if layer not in ("tasks", "flows", "orchestration")
        for module in _imports(path)
        if module == "prefect" or module.startswith("prefect.")
    ]
    assert not wrong, "\n".join(wrong)
