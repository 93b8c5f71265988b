"""Registered environment versions in the ledger.

A spec is canonicalised (every default filled in) and hashed; adding an
unchanged spec is a no-op that returns the existing version. A JSONL task
file is part of the environment: its rows are stored with the version (so a
worker on another machine needs only the ledger) and its sha256 is hashed in.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from loopline.envregistry.spec import EnvSpec, JsonlTasks, load_spec, spec_hash
from loopline.envregistry.tasks import Task, check_disjoint, file_sha256, jsonl_path, jsonl_tasks, load_tasks
from loopline.store.errors import LooplineError
from loopline.store.models import Environment


@dataclass(frozen=True)
class Registered:
    name: str
    version: int
    spec_hash: str
    created: bool

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


def stored_form(spec: EnvSpec, base_dir: Path) -> dict[str, Any]:
    """The spec as the ledger keeps it: canonical, with a JSONL task file's rows and hash embedded."""
    stored = spec.canonical()
    if isinstance(spec.tasks, JsonlTasks):
        path = jsonl_path(spec.tasks, base_dir)
        tasks = jsonl_tasks(path)
        stored["tasks"]["sha256"] = file_sha256(path)
        stored["tasks"]["rows"] = [{"id": t.id, "split": t.split, "prompt": t.prompt, **t.data} for t in tasks]
    else:
        load_tasks(spec, base_dir)  # a generator must also produce disjoint splits
    return stored


def _hashed_part(stored: dict[str, Any]) -> dict[str, Any]:
    part = copy.deepcopy(stored)
    part["tasks"].pop("rows", None)  # the rows are covered by the file's sha256
    return part


def content_hash(path: str | Path) -> str:
    """The hash `add` registers a spec file under (equal files, equal hash, in any database)."""
    file = Path(path)
    return spec_hash(_hashed_part(stored_form(load_spec(file), file.parent)))


def add(session: Session, path: str | Path) -> Registered:
    file = Path(path)
    spec = load_spec(file)
    stored = stored_form(spec, file.parent)
    digest = spec_hash(_hashed_part(stored))
    for _ in range(3):  # two processes may race for the next version number
        existing = session.execute(
            sa.select(Environment).where(Environment.name == spec.name, Environment.spec_hash == digest)
        ).scalar_one_or_none()
        if existing is not None:
            session.commit()
            return Registered(existing.name, existing.version, digest, created=False)
        latest = session.execute(
            sa.select(sa.func.max(Environment.version)).where(Environment.name == spec.name)
        ).scalar_one()
        row = Environment(
            name=spec.name,
            version=(latest or 0) + 1,
            spec_hash=digest,
            spec=stored,
            env_version=spec.versions.env,
            verifier_version=spec.versions.verifier,
            harness_version=spec.versions.harness,
        )
        session.add(row)
        try:
            session.commit()
        except IntegrityError:
            session.rollback()
            continue
        return Registered(row.name, row.version, digest, created=True)
    raise LooplineError(f"could not register {spec.name}: too many concurrent registrations, try again")


def parse_ref(ref: str) -> tuple[str, int | None]:
    name, _, version = ref.partition("@")
    if not version:
        return name, None
    if not version.isdigit():
        raise LooplineError(f"{ref!r}: expected NAME or NAME@VERSION with a number, e.g. arithmetic@2")
    return name, int(version)


def get(session: Session, ref: str) -> Environment:
    """NAME@VERSION exactly, or NAME for its newest version that is not deprecated."""
    name, version = parse_ref(ref)
    query = sa.select(Environment).where(Environment.name == name)
    if version is None:
        query = query.where(Environment.deprecated.is_(False)).order_by(Environment.version.desc()).limit(1)
    else:
        query = query.where(Environment.version == version)
    row = session.execute(query.execution_options(populate_existing=True)).scalar_one_or_none()
    session.commit()  # ends the read; with expire_on_commit=False the row stays usable
    if row is None:
        known = session.execute(
            sa.select(Environment.version).where(Environment.name == name).order_by(Environment.version)
        ).scalars().all()
        session.rollback()
        if not known:
            raise LooplineError(f"no environment named {name!r}; `envreg list` shows what is registered")
        raise LooplineError(f"{ref}: no such (non-deprecated) version; {name} has versions {', '.join(map(str, known))}")
    return row


def spec_of(row: Environment) -> EnvSpec:
    data = copy.deepcopy(row.spec)
    data["tasks"].pop("sha256", None)
    data["tasks"].pop("rows", None)
    return EnvSpec.model_validate(data)


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


def show(row: Environment) -> str:
    """The stored spec as YAML (task rows summarised, not dumped)."""
    data = spec_of(row).canonical()  # field order of the model, not of JSONB
    stored = row.spec["tasks"]
    if "rows" in stored:
        data["tasks"]["sha256"] = stored["sha256"]
        data["tasks"]["rows"] = f"<{len(stored['rows'])} tasks stored with this version>"
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def diff(a: Environment, b: Environment) -> str:
    left, right = show(a).splitlines(keepends=True), show(b).splitlines(keepends=True)
    return "".join(difflib.unified_diff(left, right, f"{a.name}@{a.version}", f"{b.name}@{b.version}"))


def deprecate(session: Session, ref: str) -> Environment:
    name, version = parse_ref(ref)
    if version is None:
        raise LooplineError(f"deprecate needs an exact version, e.g. {name}@1")
    row = get(session, ref)
    session.execute(sa.update(Environment).where(Environment.id == row.id).values(deprecated=True))
    session.commit()
    return row
