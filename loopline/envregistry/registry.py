"""Registered environment versions in the ledger.

A spec is canonicalised (every default filled in) and hashed; adding an
unchanged spec is a no-op that returns the existing version. A JSONL task
file is part of the environment: its rows are stored with the version (so a
worker on another machine needs only the ledger) and its sha256 is hashed in.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from sqlmodel import Session

from loopline.envregistry.sandbox.local import agent_cannot_reach
from loopline.envregistry.spec import EnvSpec, JsonlTasks, load_spec, spec_hash
from loopline.envregistry.tasks import Task, check_disjoint, file_sha256, jsonl_path, load_tasks
from loopline.errors import LooplineError
from loopline.store import environments
from loopline.store.models import Environment


@dataclass(frozen=True)
class Registered:
    name: str
    version: int
    spec_hash: str
    created: bool
    deprecated: bool = False

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class Prepared:
    """Everything `add` would store, computed by the one code path `validate` runs too."""

    file: Path
    spec: EnvSpec
    tasks: list[Task]
    stored: dict[str, Any]
    digest: str


def _check_storable(value: Any, where: str) -> None:
    """What PostgreSQL's JSONB cannot hold is refused here, with where it is, not as a database error."""
    if isinstance(value, str):
        if "\x00" in value:
            raise LooplineError(f"{where}: contains a NUL character (\\u0000), which cannot be stored")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise LooplineError(f"{where}: {value} is not a finite number")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_storable(key, where)
            _check_storable(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_storable(item, f"{where}[{i}]")


def prepare(path: str | Path) -> Prepared:
    """Load, validate and canonicalise a spec file and its tasks: after this, storing cannot fail on content."""
    file = Path(path)
    spec = load_spec(file)
    tasks = load_tasks(spec, file.parent)
    stored = spec.canonical()
    if isinstance(spec.tasks, JsonlTasks):
        stored["tasks"]["sha256"] = file_sha256(jsonl_path(spec.tasks, file.parent))
        stored["tasks"]["rows"] = [{"id": t.id, "split": t.split, "prompt": t.prompt, **t.data} for t in tasks]
    _check_storable(stored, str(file))
    missing = machine_problems(spec)
    if missing:
        raise LooplineError(f"{file}: {missing}")
    return Prepared(file, spec, tasks, stored, spec_hash(_hashed_part(stored)))


def machine_problems(spec: EnvSpec) -> str | None:
    """What this machine lacks to run the spec safely (None if nothing)."""
    if spec.sandbox.needs_bubblewrap and spec.runs_commands():
        if shutil.which("bwrap") is None:
            return (
                "the local backend runs commands inside bubblewrap, which is not installed "
                "(apt-get install -y bubblewrap); without it they would run unisolated on this host "
                "(allow that only with `sandbox.unsafe_host: true`)"
            )
        if os.geteuid() == 0:
            return agent_cannot_reach(Path(tempfile.gettempdir()))
    return None


def _hashed_part(stored: dict[str, Any]) -> dict[str, Any]:
    part = copy.deepcopy(stored)
    part["tasks"].pop("rows", None)  # the rows are covered by the file's sha256
    return part


def content_hash(path: str | Path) -> str:
    """The hash `add` registers a spec file under (equal files, equal hash, in any database)."""
    return prepare(path).digest


def add(session: Session, source: str | Path | Prepared) -> Registered:
    prepared = source if isinstance(source, Prepared) else prepare(source)
    spec, stored, digest = prepared.spec, prepared.stored, prepared.digest
    labels = {"env_version": spec.versions.env, "verifier_version": spec.versions.verifier, "harness_version": spec.versions.harness}
    for _ in range(3):  # two processes may race for the next version number
        existing = environments.find(session, spec.name, spec_hash=digest)
        if existing is not None:
            return Registered(existing.name, existing.version, digest, created=False, deprecated=existing.deprecated)
        row = environments.insert_next_version(session, spec.name, digest, stored, labels)
        if row is not None:
            return Registered(row.name, row.version, digest, created=True)
    raise LooplineError(f"could not register {spec.name}: too many concurrent registrations, try again")


def parse_ref(ref: str) -> tuple[str, int | None]:
    name, _, version = ref.partition("@")
    if not version:
        return name, None
    if not (version.isascii() and version.isdigit()) or len(version) > 9:  # (the ledger's versions are 32-bit)
        raise LooplineError(f"{ref[:80]!r}: expected NAME or NAME@VERSION with a version number below 10^9, e.g. arithmetic@2")
    return name, int(version)


def get(session: Session, ref: str) -> Environment:
    """NAME@VERSION exactly, or NAME for its newest version that is not deprecated."""
    name, version = parse_ref(ref)
    row = environments.find(session, name, version)
    if row is None:
        known = environments.versions(session, name)
        if not known:
            raise LooplineError(f"no environment named {name!r}; `envreg list` shows what is registered")
        raise LooplineError(f"{ref}: no such (non-deprecated) version; {name} has versions {', '.join(map(str, known))}")
    return row


def spec_of(row: Environment) -> EnvSpec:
    data = copy.deepcopy(row.spec)
    data["tasks"].pop("sha256", None)
    data["tasks"].pop("rows", None)
    try:
        return EnvSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise LooplineError(
            f"{row.name}@{row.version} was registered under an older spec format that this loopline refuses "
            f"({'.'.join(map(str, first['loc']))}: {first['msg']}); fix its YAML and `envreg add` it again"
        ) from None


def tasks_of(row: Environment) -> list[Task]:
    spec = spec_of(row)
    if isinstance(spec.tasks, JsonlTasks):
        rows = row.spec["tasks"]["rows"]
        tasks = [
            Task(str(r["id"]), r["split"], r["prompt"], {k: v for k, v in r.items() if k not in ("id", "split", "prompt")})
            for r in rows
        ]
        check_disjoint(tasks, f"{row.name}@{row.version}")
        return tasks
    return load_tasks(spec, Path("."))


class _ShowDumper(yaml.SafeDumper):
    """Multi-line text (scripts, hidden tests) as `|` blocks, the way a user writes it."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value and not any(line != line.rstrip() for line in value.splitlines()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ShowDumper.add_representer(str, _text)


def show(row: Environment) -> str:
    """The stored spec as YAML (task rows summarised, not dumped)."""
    spec = spec_of(row)
    data = spec.canonical()  # field order of the model, not of JSONB
    if not spec.sandbox.uses_workdir:
        del data["sandbox"]["workdir"]
    stored = row.spec["tasks"]
    if "rows" in stored:
        data["tasks"]["sha256"] = stored["sha256"]
        data["tasks"]["rows"] = f"<{len(stored['rows'])} tasks stored with this version>"
    return yaml.dump(data, Dumper=_ShowDumper, sort_keys=False, allow_unicode=True)


def diff(a: Environment, b: Environment) -> str:
    left, right = show(a).splitlines(keepends=True), show(b).splitlines(keepends=True)
    return "".join(difflib.unified_diff(left, right, f"{a.name}@{a.version}", f"{b.name}@{b.version}"))


def set_deprecated(session: Session, ref: str, deprecated: bool) -> Environment:
    """Deprecate (hide from NAME lookups) or restore one exact version; saying it twice is an error."""
    verb = "deprecate" if deprecated else "undeprecate"
    name, version = parse_ref(ref)
    if version is None:
        raise LooplineError(f"{verb} needs an exact version, e.g. {name}@1")
    row = get(session, ref)
    if row.deprecated == deprecated:
        raise LooplineError(f"{ref} is {'already' if deprecated else 'not'} deprecated")
    environments.set_deprecated(session, row, deprecated)
    return row
