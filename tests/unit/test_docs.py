"""The docs as a user meets them: the site builds with every link, page and setting description in place, and
every YAML, command and Python block in it (and in the README) is one that works: a YAML block validates as a
run config or an environment spec (or a fragment of one), a `loopline`/`envreg` command parses with the CLI,
a module or file a command names exists, a Python block compiles and imports names that exist."""

from __future__ import annotations

import ast
import copy
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "stub" not in p.parts) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)
# First words of commands that are not loopline's and are shown as they are (installers, other tools' CLIs).
OTHER_TOOLS = {"pip", "export", "prefect", "deepspeed", "mkdocs", "apt-get", "docker", "mlflow", "wandb", "cd", "git",
               "curl", "echo", ".", "source", "grep", "sed", "xargs"}


def _blocks(language: str) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == language:
                body = SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text(), match.group(2))
                line = text[: match.start()].count("\n") + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", body))
    return found


def _commands(body: str) -> list[list[str]]:
    """Each command of a shell block as its words: continuation lines joined, a quote spanning lines kept whole,
    comments, `&&` chains and leading VAR=value assignments taken apart."""
    commands, pending = [], ""
    for line in re.sub(r"\\\n\s*", " ", body).splitlines():
        pending += ("\n" if pending else "") + line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # (an open quote: the command goes on)
            continue
        pending, command = "", []
        for word in words + [";"]:
            if word in ("&&", "||", ";", "|"):
                while command and re.fullmatch(r"[A-Z_]+=\S*", command[0]):
                    command.pop(0)
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word.rstrip(";"))
    return commands


def test_the_site_builds_strict_with_its_generated_reference(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav, a setting without a
    description (the reference generator refuses it) each fail the build."""
    site = tmp_path / "site"
    quiet = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}  # (two plugins' banners)
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env=quiet)
    assert result.returncode == 0, result.stderr[-4000:]
    for page, expected in {"reference/run-config/index.html": "micro_batch_tokens",
                           "reference/env-spec/index.html": "max_generated_tokens",
                           "reference/cli/index.html": "--max-context",
                           "reference/metrics/index.html": "clip_fraction",
                           "reference/invariants/index.html": "nothing is trained twice",
                           "reference/environment/index.html": "LOOPLINE_DB_LOCK_TIMEOUT_S",
                           "architecture/layers/index.html": "envregistry",
                           "reference/api/index.html": "the per-token surrogate"}.items():  # (PolicyLoss's docstring)
        assert expected in (site / page).read_text(), page


def test_the_reference_generator_refuses_a_setting_without_a_description():
    from pydantic import BaseModel, Field

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))

    class Section(BaseModel):
        documented: int = Field(1, description="says what it is for")
        bare: int = 2

    class Config(BaseModel):
        section: Section = Field(Section(), description="a section")

    with pytest.raises(docs_reference.UndocumentedField, match="section.bare"):
        docs_reference.settings_reference(Config, "t", "i")


def _merged(base: dict, fragment: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in fragment.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


YAML_BLOCKS = _blocks("yaml")


@pytest.mark.parametrize("where,body", YAML_BLOCKS, ids=[where for where, _ in YAML_BLOCKS])
def test_every_yaml_block_validates_as_a_run_config_or_an_env_spec(where, body, monkeypatch):
    from pydantic import ValidationError

    from loopline.config import parse_config
    from loopline.envregistry.spec import EnvSpec
    from loopline.errors import LooplineError

    monkeypatch.syspath_prepend(str(ROOT / "examples" / "plugins"))  # (the extend page's module, on PYTHONPATH as it says)
    data = yaml.safe_load(body)
    assert isinstance(data, dict), f"{where}: a YAML block shows a mapping"
    run_base = yaml.safe_load((ROOT / "examples" / "arithmetic_quickstart.yaml").read_text())
    env_base = yaml.safe_load((ROOT / "examples" / "agents" / "arithmetic_tools_env.yaml").read_text())
    errors = []
    if "sandbox" in data or "verifier" in data or "tasks" in data or "agent" in data:
        try:  # a spec, or a fragment of one (over an agent env)
            EnvSpec.model_validate(data if "sandbox" in data else _merged(env_base, data))
            return
        except ValidationError as e:
            errors.append(f"as an env spec: {e}")
    try:  # a run config, or a fragment of one (over the quickstart's)
        parse_config(data if "name" in data and "env" in data else _merged(run_base, data), where)
        return
    except LooplineError as e:
        errors.append(f"as a run config: {e}")
    pytest.fail(f"{where}: " + "\n".join(errors))


def _loopline_clis():
    import typer.main

    from loopline.cli import app as loopline_app
    from loopline.envreg import app as envreg_app

    return {"loopline": typer.main.get_command(loopline_app), "envreg": typer.main.get_command(envreg_app)}


def _parse(command, words: list[str]) -> None:
    """Parse as the CLI would, down to the subcommand, without running anything (typer's own click: no `import click`)."""
    ctx = command.make_context(command.name, list(words))
    while hasattr(command, "resolve_command") and (rest := [*ctx._protected_args, *ctx.args]):
        name, command, rest = command.resolve_command(ctx, rest)
        assert command is not None, f"no command {name}"
        ctx = command.make_context(name, rest, parent=ctx)


def test_every_command_in_the_docs_parses_or_names_what_exists():
    clis = _loopline_clis()
    wrong = []
    for where, body in _blocks("bash"):
        for words in _commands(body):
            first = words[0]
            try:
                if first in clis:
                    _parse(clis[first], words[1:])
                elif first in ("python", "python3") and words[1] == "-m":
                    module = words[2]  # ours must exist; another tool's (pytest, pip, venv, sglang) is its own
                    if module.startswith(("benchmarks.", "loopline")):
                        assert importlib.util.find_spec(module) is not None, f"no module {module}"
                elif first in ("python", "python3", "bash"):
                    assert (ROOT / words[1]).exists(), f"no file {words[1]}"
                elif not (first in OTHER_TOOLS or first.endswith(("/pip", "/python", "/python3"))):
                    raise AssertionError(f"unknown command {first!r}: parse it here or add it to OTHER_TOOLS")
            except Exception as e:  # (click's usage errors, our assertions: each reported with its place)
                wrong.append(f"{where}: {' '.join(words)}: {type(e).__name__}: {e}")
    assert not wrong, "\n".join(wrong)


def _defined(module: str) -> set[str] | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    if spec.submodule_search_locations:  # a package: its submodules are importable names too
        names = {p.stem for loc in spec.submodule_search_locations for p in Path(loc).glob("*.py")}
    else:
        names = set()
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_every_python_block_compiles_and_imports_what_exists():
    wrong = []
    for where, body in _blocks("python"):
        try:
            tree = ast.parse(body)
        except SyntaxError as e:
            wrong.append(f"{where}: {e}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("loopline"):
                names = _defined(node.module)
                if names is None:
                    wrong.append(f"{where}: no module {node.module}")
                else:
                    wrong += [f"{where}: {node.module} has no {a.name}" for a in node.names if a.name not in names]
    assert not wrong, "\n".join(wrong)


def test_the_readme_is_a_page_and_its_links_lead_somewhere():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150, "the README is the front page; details belong in docs/"
    broken = [link for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
              if not link.startswith("http") and not (ROOT / link).exists()]
    assert not broken, broken
    assert text.splitlines()[2:6] == [  # the two commands a new user types first
        "```bash",
        'pip install -e ".[dev]" && loopline train examples/arithmetic_quickstart.yaml   # install, run the main job',
        "python -m pytest                                                                # the tests (what .ci/run runs)",
        "```",
    ]


def test_every_metric_the_learner_declares_is_described():
    """The loss's declared metrics and the learner's own reach the ledger (and the trackers) by these names."""
    from loopline.metrics import METRICS
    from loopline.trainer import losses
    from loopline.trainer.learner import OWN_TOKEN_MEANS

    declared = set(losses.MAXIMA + losses.TOKEN_MEANS + OWN_TOKEN_MEANS) | (set(losses.SUMMED) - {"tokens"})
    assert declared <= set(METRICS), declared - set(METRICS)


def test_every_environment_variable_the_code_reads_is_documented_and_none_that_it_does_not():
    """A `LOOPLINE_*` name in the package's source is a variable someone sets or reads: the reference page
    (`loopline/envvars.py`) lists exactly those (the chat template's private markers are not variables)."""
    from loopline.envvars import PROVIDED, SETTINGS

    package = ROOT / "loopline"
    named = {name for path in package.rglob("*.py") if path.name != "envvars.py"
             for name in re.findall(r"LOOPLINE_[A-Z_]*[A-Z]", path.read_text())}
    named -= {"LOOPLINE_ASSISTANT", "LOOPLINE_OBSERVATION", "LOOPLINE_OBSERVATION_"}  # (rollout/harness/chat.py's markers)
    documented = set(SETTINGS) | set(PROVIDED)
    assert not named - documented, f"add to loopline/envvars.py: {sorted(named - documented)}"
    assert not documented - named, f"read nowhere: {sorted(documented - named)}"


def test_loopline_metrics_prints_every_metric_with_its_meaning():
    """The metric reference from the terminal, where a user reading a tracker's chart looks a name up."""
    from loopline.metrics import EVAL_METRICS, METRICS

    shown = subprocess.run([sys.executable, "-m", "loopline.cli", "metrics"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "400"})
    lines = {line.split()[0]: " ".join(line.split()[1:]) for line in shown.stdout.splitlines() if line.strip()}
    assert shown.returncode == 0 and all(lines.get(name) == " ".join(meaning.split()) for name, meaning in {**METRICS, **EVAL_METRICS}.items()), shown.stdout
