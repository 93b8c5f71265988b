"""The docs' reference pages, written from the code at every `mkdocs build` (the mkdocs-gen-files plugin runs
this file), so they cannot drift from it: every run-config and environment-spec field with its type, default
and description (a field without a description fails the build), every CLI command and flag (from the Typer
apps), every metric (`loopline.metrics`), every environment variable (`loopline.envvars`), the invariants `loopline check` verifies, and the layers (the layer
test's own table); the benchmarks' plots are served from `benchmarks/results/` as they are."""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel

from loopline.registry import RegistryName, RegistrySection


class UndocumentedField(Exception):
    """A setting without a description would reach users unexplained: the build fails instead."""


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _component_section(annotation: Any) -> tuple[str, type, dict[type, str]] | None:
    """A section whose components bring their settings: what the base is shared by (`every kind; local: these
    alone`), its base model, and each component's model -> which names bring it (`correction: mis / rejection`)."""
    if typing.get_origin(annotation) is typing.Annotated:
        for section in (m for m in annotation.__metadata__ if isinstance(m, RegistrySection)):
            base, models = typing.get_args(annotation)[0], {}
            for key, registry in section.registries.items():
                for name, model in registry.settings_models(base).items():
                    models.setdefault(model, {}).setdefault(key, []).append(name)
            labels = {model: "; ".join(f"{key}: {' / '.join(names)}" for key, names in keys.items()) for model, keys in models.items()}
            alone = models.get(base, {}).get(section.key) if len(section.registries) == 1 else None
            shared = f"every {', '.join(section.registries)}" + (f"; {' / '.join(alone)}: these alone" if alone else "")
            return shared, base, {model: label for model, label in labels.items() if model is not base} | {base: ""}
    return None


def _models_in(annotation: Any) -> list[type]:
    if component := _component_section(annotation):  # the base (what every component shares), then each one's own
        _, base, models = component
        return [base, *(m for m in models if m is not base)]
    if _is_section(annotation):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _fields(model: type) -> list[tuple[str, Any, str, str | None]]:
    """(name, type, default, description) of a settings model's fields (a name chosen from a registry: its names)."""
    return [(name, next((Literal[tuple(m.registry.names)] if isinstance(m, RegistryName) else typing.Annotated[f.annotation, m]
                         for m in f.metadata if isinstance(m, (RegistryName, RegistrySection))), f.annotation),
             _default(f.is_required(), lambda f=f: f.get_default(call_default_factory=True)), f.description)
            for name, f in model.model_fields.items()]


def _type(annotation: Any, anchors: dict[type, str]) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return " / ".join(f"`{json.dumps(a)}`" if not isinstance(a, str) else f"`{a}`" for a in args)
    if origin is typing.Annotated:
        return _type(args[0], anchors)
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a, anchors) for a in args)
    if origin in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        return f"list of {_type(inner[0], anchors)}" if inner and (origin is list or Ellipsis in args) else "list [" + ", ".join(_type(a, anchors) for a in inner) + "]"
    if origin is dict:
        return f"map of {_type(args[0], anchors)} to {_type(args[1], anchors)}"
    if _is_section(annotation):
        return f"[section](#{anchors[annotation]})" if annotation in anchors else annotation.__name__
    if annotation is typing.Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _default(required: bool, value_of) -> str:
    if required:
        return "required"
    value = value_of()
    if isinstance(value, BaseModel):
        return "(its section's defaults)"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def settings_reference(root: type, title: str, intro: str) -> str:
    """One table per section (a nested model), headed by its path in the YAML (`learner.loss`)."""
    sections: list[tuple[str, type]] = []  # (heading, section)
    anchors: dict[type, str] = {}
    missing: list[str] = []
    inherited: dict[type, set[str]] = {}  # a component's settings: the base's fields are in the base's table

    def shown(model: type) -> list[tuple[str, Any, str, str | None]]:
        return [f for f in _fields(model) if f[0] not in inherited.get(model, set())]

    def walk(model: type, path: str, tag: str = "", anchor: str | None = None) -> None:
        if model in anchors:
            return
        anchors[model] = re.sub(r"[^a-z0-9_]+", "-", (f"{path}{tag}" if anchor is None else anchor).lower()).strip("-") or "top-level"
        sections.append((f"`{path}`{tag}" if path else "Top level", model))
        for name, annotation, _, description in shown(model):
            if not description:
                missing.append(f"{path}.{name}" if path else name)
            nested, component = _models_in(annotation), _component_section(annotation)
            for inner in nested:
                kind = next((a for n, a, _, _ in _fields(inner) if n == "kind"), None)
                tag = f" (kind: {typing.get_args(kind)[0]})" if kind is not None and len(nested) > 1 else ""
                if component is not None:
                    shared, base, models = component
                    names = models[inner]
                    if inner is base:
                        tag = f" ({shared})"
                    else:
                        tag, inherited[inner] = f" ({names}: these as well)", {n for n, *_ in _fields(base)}
                containers = {typing.get_origin(annotation), *(typing.get_origin(a) for a in typing.get_args(annotation))}
                suffix = "[]" if containers & {list, tuple} else ".NAME" if dict in containers else ""
                where = f"{path + '.' if path else ''}{name}{suffix}"
                walk(inner, where, tag, None if component is None else where if inner is component[1] else f"{where} {re.sub(r'[a-z_]+: ', '', names)}")

    walk(root, "")
    if missing:
        raise UndocumentedField(f"{root.__name__}: settings without a description: {', '.join(missing)} (add Field(description=...))")
    out = [f"# {title}\n", intro, ""]
    for heading, model in sections:
        out += [f"## {heading} {{#{anchors[model]}}}\n"]
        if model.__doc__ and model is not root and not model.__doc__.startswith(model.__name__ + "("):
            out += [" ".join(model.__doc__.split()), ""]
        out += ["| setting | type | default | what it is for |", "|---|---|---|---|"]
        for name, annotation, default, description in shown(model):
            out.append(f"| `{name}` | {_cell(_type(annotation, anchors))} | {_cell(default)} | {_cell(description or '')} |")
        out.append("")
    return "\n".join(out)


def run_config_page() -> str:
    from loopline.config import RunConfig

    return settings_reference(
        RunConfig,
        "Run config",
        "A run config is the YAML `loopline train` takes (`examples/arithmetic_quickstart.yaml`). Unknown settings "
        "are refused (with a did-you-mean); `loopline schema` prints the same settings as a JSON Schema for an "
        "editor. Generated from `loopline/config.py` and `loopline/trainer/config.py`.",
    )


def env_spec_page() -> str:
    from loopline.envregistry.spec import EnvSpec

    return settings_reference(
        EnvSpec,
        "Environment spec",
        "An environment spec is the YAML `envreg add` registers (`examples/arithmetic_env.yaml`, "
        "`examples/coding_env.yaml`). `envreg validate FILE` runs every check without writing anything; "
        "`envreg schema` prints the JSON Schema. Generated from `loopline/envregistry/spec.py`.",
    )


def cli_page() -> str:
    import typer.main
    from typer.cli import get_docs_for_click

    from loopline.cli import app as loopline_app
    from loopline.envreg import app as envreg_app

    out = ["# Command line\n", "Every command and flag of `loopline` and `envreg`, generated from their parsers. "
           "`--help` after any command prints the same.\n"]
    for name, app in (("loopline", loopline_app), ("envreg", envreg_app)):
        command = typer.main.get_command(app)
        docs = get_docs_for_click(obj=command, ctx=typer.Context(command), name=name, indent=1)
        out.append(docs)
    return "\n".join(out)


def metrics_page() -> str:
    from loopline.metrics import EVAL_METRICS, METRICS

    out = ["# Metrics\n", "What each learner step records in the ledger's `metric` table, and so sends to every tracker "
           "(`tracking:`), at the step's number. Generated from `loopline/metrics.py`.\n",
           "| metric | what it is |", "|---|---|"]
    out += [f"| `{name}` | {_cell(text)} |" for name, text in METRICS.items()]
    out += ["", "Each evaluation sends these at its version's step (the ledger keeps evaluations in `eval_result`):\n",
            "| metric | what it is |", "|---|---|"]
    out += [f"| `{name}` | {_cell(text)} |" for name, text in EVAL_METRICS.items()]
    return "\n".join(out) + "\n"


def invariants_page() -> str:
    from loopline.store.check import INVARIANTS

    out = ["# Invariants\n", "What `loopline check RUN` verifies on a run's ledger rows (exit 1 on a violation, naming the "
           "rows). Generated from `loopline/store/check.py`.\n", "| # | invariant |", "|---|---|"]
    out += [f"| {number} | {_cell(text)} |" for number, text in INVARIANTS.items()]
    return "\n".join(out) + "\n"


def environment_page() -> str:
    from loopline.envvars import PROVIDED, SETTINGS

    out = ["# Environment variables\n", "Every `LOOPLINE_*` variable. Generated from `loopline/envvars.py` (a test fails on "
           "a variable the code reads and this page misses). Run settings belong in the run config; these are for what "
           "lies outside one run: where the data lives, how long to wait, what to import.\n",
           "## What you set\n", "| variable | what it does |", "|---|---|"]
    out += [f"| `{name}` | {_cell(text)} |" for name, text in SETTINGS.items()]
    out += ["", "## What loopline sets for your programs\n", "An environment's verifier and agent programs (and loopline's "
            "own child processes) find these in their environment:\n", "| variable | what it holds |", "|---|---|"]
    out += [f"| `{name}` | {_cell(text)} |" for name, text in PROVIDED.items()]
    return "\n".join(out) + "\n"


def layers_table() -> str:
    from tests.unit.test_layers import ALLOWED, NEUTRAL, TOP

    out = ["| layer (`loopline/...`) | may import |", "|---|---|"]
    out += [f"| `{layer}` | {', '.join(f'`{t}`' for t in sorted(allowed)) or 'nothing of loopline'} |" for layer, allowed in ALLOWED.items()]
    out += ["", f"Every layer may import the neutral modules: {', '.join(f'`{m}`' for m in sorted(NEUTRAL))}. Above every "
            f"layer, importable by none: {', '.join(f'`{m}`' for m in sorted(TOP - {'__init__'}))} (the command lines). No module "
            "imports itself back through others, not even from inside a function."]
    return "\n".join(out) + "\n"


PAGES = {
    "reference/run-config.md": run_config_page,
    "reference/env-spec.md": env_spec_page,
    "reference/cli.md": cli_page,
    "reference/metrics.md": metrics_page,
    "reference/invariants.md": invariants_page,
    "reference/environment.md": environment_page,
    "architecture/layers.md": lambda: "# Layers\n\nGenerated from the layer test's table (`tests/unit/test_layers.py`), "
    "which checks every import of the source against it.\n\n" + layers_table(),
}


if __name__ == "<run_path>":  # run by mkdocs-gen-files during `mkdocs build`
    import mkdocs_gen_files

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the layer test's table: tests/unit/test_layers.py)

    for page, write in PAGES.items():
        with mkdocs_gen_files.open(page, "w") as f:
            f.write(write())
    root = Path(__file__).resolve().parents[1]
    for plot in sorted((root / "benchmarks" / "results").glob("*.png")):  # (the benchmarks' own files, not copies)
        with mkdocs_gen_files.open(f"benchmarks/results/{plot.name}", "wb") as f:
            f.write(plot.read_bytes())
