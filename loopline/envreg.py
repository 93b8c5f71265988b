"""`envreg`: register, inspect and test environments. A command line, so above the layers it drives: the registry
(`loopline.envregistry`), the ledger, and the rollout layer's player for envs whose agent is a program."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from loopline import aio
from loopline.cli_support import console, friendly_errors, run_cli, stop_on_signals
from loopline.envregistry import e2b_template, images, registry
from loopline.envregistry.smoke import run_smoke
from loopline.envregistry.spec import json_schema
from loopline.store.db import session
from loopline.errors import LooplineError
from loopline.store.migrate import open_ledger
from loopline.store import environments
from loopline.rollout.harness.agent_program import play_scripted
from loopline.config import SamplingConfig

app = typer.Typer(help="Register, inspect and test environments.", no_args_is_help=True)
app.callback()(stop_on_signals)  # (SIGTERM and a closed terminal stop a command as loopline's do)
image_app = typer.Typer(help="Sandbox images, built without any image registry.", no_args_is_help=True)
sandbox_app = typer.Typer(help="Running sandboxes.", no_args_is_help=True)
e2b_app = typer.Typer(help="E2B templates a verifier can trust.", no_args_is_help=True)
app.add_typer(image_app, name="image")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(e2b_app, name="e2b-template")


@image_app.command("build")
@friendly_errors
def image_build(
    tag: str = typer.Option(None, help=f"Image name:tag to create (default {images.PYTHON_IMAGE}; with --pip {images.AGENT_IMAGE})."),
    pip: list[str] = typer.Option([], "--pip", help="Add these Python packages (an agent program's libraries, e.g. openai) on top of --base."),
    base: str = typer.Option(images.PYTHON_IMAGE, help="With --pip: the image to add them to (built first if it is the default and missing)."),
) -> None:
    """Build the Python sandbox image the examples use (debootstrap + docker import; ~1 minute, needs root), or with
    --pip an image for agent programs: that image plus your program's Python packages."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    tag = tag or (images.AGENT_IMAGE if pip else images.PYTHON_IMAGE)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True) as bar:
        if not pip or (base == images.PYTHON_IMAGE and not images.image_exists(base)):
            built = base if pip else tag
            stage = bar.add_task(f"building {built}: debootstrap of a minimal Debian with python3", total=None)
            images.build_python_image(built, progress=lambda line: bar.update(stage, description=f"building {built}: {line}"))
        if pip:
            stage = bar.add_task(f"building {tag}", total=None)
            images.add_pip_packages(base, tag, tuple(pip), progress=lambda line: bar.update(stage, description=f"building {tag}: {line}"))
    console.print(f"built {tag}")


@e2b_app.command("build")
@friendly_errors
def e2b_template_build(
    name: str = typer.Argument(..., help="The template's name, for `sandbox.template` in an env spec."),
    base: str = typer.Option(e2b_template.DEFAULT_BASE, "--from", help="The image to start from (needs python3 and util-linux)."),
) -> None:
    """Build loopline's E2B template recipe on E2B (needs E2B_API_KEY): `--from` image, then, as root after E2B's own
    provisioning, no sudo for `user`, no setuid programs, system directories root's alone. E2B's default
    provisioning lets the agent's code become root; loopline refuses such a template for verification."""
    if not os.environ.get("E2B_API_KEY"):
        raise LooplineError("building an E2B template needs E2B_API_KEY (your key from e2b.dev)")
    built = e2b_template.build(name, base, on_log=lambda entry: console.print(str(entry), highlight=False))
    console.print(f"built E2B template {name} ({getattr(built, 'template_id', built)}): use `sandbox: {{backend: e2b, template: {name}}}`")


@sandbox_app.command("gc")
@friendly_errors
def sandbox_gc() -> None:
    """Remove sandboxes (local directories, Docker containers) left behind by processes that crashed."""
    from loopline.envregistry.sandbox import docker, local
    from loopline.envregistry.sandbox.base import InfraFailure

    removed = local.cleanup_orphans()
    try:
        removed += docker.cleanup_orphans()
    except InfraFailure as exc:
        console.print(f"skipped Docker: {exc}")
    console.print(f"removed {len(removed)} orphaned sandbox(es)" + (f": {', '.join(removed)}" if removed else ""))


READ_LIMIT_ENV = "LOOPLINE_ENVREG_TIMEOUT"


@contextlib.contextmanager
def wall_time_guard(what: str):
    """Reading a spec must not hang: past the limit (60 s, or $LOOPLINE_ENVREG_TIMEOUT) it is an error."""
    limit = float(os.environ.get(READ_LIMIT_ENV, "60"))

    def expire(*_):
        raise LooplineError(f"gave up on {what} after {limit:g} s (${READ_LIMIT_ENV} sets the limit)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    except (RecursionError, MemoryError) as exc:
        raise LooplineError(f"{what}: too large or too deeply nested to read ({type(exc).__name__})") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@app.command("validate")
@friendly_errors
def validate(file: Path) -> None:
    """Check a spec and its tasks exactly as `add` would, without writing anything."""
    with wall_time_guard(str(file)):
        prepared = registry.prepare(file)
    splits = {s: sum(t.split == s for t in prepared.tasks) for s in ("train", "eval")}
    spec = prepared.spec
    console.print(f"{file}: valid ({spec.name}, {spec.sandbox.backend} sandbox, {splits['train']} train / {splits['eval']} eval tasks)")


@app.command("add")
@friendly_errors
def add(file: Path) -> None:
    """Register a spec; an unchanged spec is a no-op that prints the existing NAME@VERSION."""
    with wall_time_guard(str(file)):
        prepared = registry.prepare(file)  # before the database: a bad file never touches it
    with session(open_ledger()) as s:
        result = registry.add(s, prepared)
    note = f" (deprecated: `envreg undeprecate {result.ref}` restores it)" if result.deprecated else ""
    console.print(f"{'registered' if result.created else 'unchanged'} {result.ref}{note}")


@app.command("list")
@friendly_errors
def list_environments(all_versions: bool = typer.Option(False, "--all", help="Include deprecated versions.")) -> None:
    """List registered environments, newest version first."""
    with session(open_ledger()) as s:
        envs = environments.listing(s, include_deprecated=all_versions)
    if not envs:
        console.print("no environments registered (`envreg add FILE` registers one)")
        return
    table = Table("name@version", "env", "verifier", "harness", "spec hash", "created")
    for env in envs:
        label = f"{env.name}@{env.version}" + (" (deprecated)" if env.deprecated else "")
        table.add_row(label, env.env_version, env.verifier_version, env.harness_version, env.spec_hash[:12], f"{env.created_at:%Y-%m-%d %H:%M}")
    console.print(table)


@app.command("show")
@friendly_errors
def show(ref: str = typer.Argument(..., metavar="NAME[@VERSION]")) -> None:
    """Print a registered version's stored spec as YAML."""
    with session(open_ledger()) as s:
        row = registry.get(s, ref)
    sys.stdout.write(f"# {row.name}@{row.version}  sha256:{row.spec_hash}\n" + registry.show(row))


@app.command("diff")
@friendly_errors
def diff(a: str = typer.Argument(..., metavar="NAME@A"), b: str = typer.Argument(..., metavar="NAME@B")) -> None:
    """Unified diff between two registered versions."""
    with session(open_ledger()) as s:
        text = registry.diff(registry.get(s, a), registry.get(s, b))
    sys.stdout.write(text or "no differences\n")


@app.command("deprecate")
@friendly_errors
def deprecate(ref: str = typer.Argument(..., metavar="NAME@VERSION")) -> None:
    """Hide a version from `list` and from NAME lookups (runs that used it keep it)."""
    _set_deprecated(ref, True, "deprecated")


@app.command("undeprecate")
@friendly_errors
def undeprecate(ref: str = typer.Argument(..., metavar="NAME@VERSION")) -> None:
    """Make a deprecated version visible to `list` and NAME lookups again."""
    _set_deprecated(ref, False, "restored")


def _set_deprecated(ref: str, deprecated: bool, done: str) -> None:
    with session(open_ledger()) as s:
        row = registry.set_deprecated(s, ref, deprecated)
    console.print(f"{done} {row.name}@{row.version}")


@app.command("schema")
def schema() -> None:
    """Print the spec's JSON Schema (for editor completion and validation)."""
    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")


def _print_steps(result) -> None:
    console.print(Text(f"task {result.task_id}", style="bold"))
    for i, step in enumerate(result.steps, 1):
        console.print(Text(f"  {i}. {step.call}  ({step.seconds * 1000:.0f} ms)"))
        for line in (step.output or "(no output)").splitlines() or [""]:
            console.print(Text(f"     | {line}"))
    if result.answer is not None:
        console.print(Text(f"  answer: {result.answer}"))
    outcome = f"infra failure: {result.infra_error}" if result.infra_error else f"reward {result.reward:g} {result.verdict}"
    console.print(Text(f"  verdict: {outcome}"))


def _starter_for(digest: str, spec) -> tuple[Path, str]:
    """The tiny starter a run with `policy: tiny` trains on this env (its tokenizer is built from the env's own
    texts: another starter's spent 67 tokens on a `<tool_call>` line this env's spends 29 on), built or shipped;
    before it exists, the shipped starter that says the smoke test's replies in the fewest tokens."""
    from loopline.policies.sources import SHIPPED_STARTERS, tiny_policy_dir, tiny_policy_name

    for own in (tiny_policy_dir(digest, 0), SHIPPED_STARTERS / tiny_policy_name(digest, 0)):
        if (own / "config.json").is_file():
            return own, f"this env's tiny starter ({own.name})"
    from transformers import AutoTokenizer

    shipped = [p for p in sorted(SHIPPED_STARTERS.iterdir()) if (p / "config.json").is_file()]
    cost = lambda p: sum(len(AutoTokenizer.from_pretrained(p).encode(reply)) for reply in spec.smoke_test.replies)  # noqa: E731
    nearest = min(shipped, key=cost)
    return nearest, f"the shipped starter {nearest.name} (this env's own is built by its first `loopline train` with `policy: tiny`)"


@app.command("test")
@friendly_errors
def test(
    ref: str = typer.Argument(..., metavar="NAME[@VERSION] | FILE.yaml", help="A registered env, or a spec file (played unregistered)."),
    tasks: int = typer.Option(1, "--tasks", min=1, help="How many tasks to play."),
    split: str = typer.Option("train", "--split", help="train or eval: which tasks to play."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print each step's call, output and time, and the verdict."),
    max_context: int = typer.Option(
        None, "--max-context", min=1, metavar="TOKENS",
        help="An env with `agent:`: the context its model calls must fit, as your policy's engine would refuse them (default: the tiny starter's).",
    ),
    max_new_tokens: int = typer.Option(
        SamplingConfig.model_fields["max_new_tokens"].default, "--max-new-tokens", min=1, metavar="TOKENS",
        help="An env with `agent:`: the most tokens one model call may generate, your run's rollout.sampling.max_new_tokens (a prompt must leave room for them).",
    ),
    policy: Path = typer.Option(
        None, "--policy", metavar="DIR", exists=True, file_okay=False,
        help="An env with `agent:`: the model directory whose tokenizer, chat template and context its calls are counted in (default: the tiny starter `policy: tiny` trains on this env).",
    ),
) -> None:
    """Reset, play the spec's scripted smoke test, verify and tear down; exit 1 unless every task scores as expected."""
    if split not in ("train", "eval"):
        raise LooplineError(f"--split must be train or eval, not {split!r}")
    if ref.endswith((".yaml", ".yml")):  # a spec file, checked as `add` would, played without touching the ledger
        prepared = registry.prepare(ref)
        spec, all_tasks, title, digest = prepared.spec, prepared.tasks, f"{prepared.spec.name} ({ref}, not registered)", prepared.digest
    else:
        with session(open_ledger()) as s:
            row = registry.get(s, ref)
        spec, all_tasks, title, digest = registry.spec_of(row), registry.tasks_of(row), f"{row.name}@{row.version}", row.spec_hash
    if spec.smoke_test is None:
        raise LooplineError(f"{title} declares no smoke_test; add one to its YAML")
    chosen = [t for t in all_tasks if t.split == split][:tasks]
    results = []
    player = None
    if spec.agent is not None:
        model, which = (policy, str(policy)) if policy else _starter_for(digest, spec)
        player = functools.partial(play_scripted, policy=model, max_context=max_context, max_new_tokens=max_new_tokens)
        context = f"a context of {max_context:,} tokens" if max_context else "its context"
        console.print(f"the program's model calls are counted in the tokens of {which} and must fit {context} (--policy DIR, --max-context TOKENS: your policy's)")
    for task in chosen:
        with console.status(f"playing {task.id} ({len(results) + 1}/{len(chosen)})"):
            results.append(aio.run(run_smoke(spec, task, player)))
        if verbose:
            _print_steps(results[-1])
    expected = spec.smoke_test.expect_reward
    table = Table("task", "start", "reset", "steps", "verify", "close", "reward", "verdict", title=title)
    for r in results:
        times = [f"{r.timings.get(p, 0.0) * 1000:.0f} ms" for p in ("start", "reset", "steps", "verify", "close")]
        if r.infra_error:
            verdict = Text(f"infra: {r.infra_error}", style="red")
        else:
            verdict = Text("ok", style="green") if r.passed(expected) else Text(str(r.verdict), style="red")
        table.add_row(r.task_id, *times, "-" if r.reward is None else f"{r.reward:g}", verdict)
    console.print(table)
    failed = [r for r in results if not r.passed(expected)]
    for r in failed:  # (a refusal's reason, a context too short, is in the answer the player made of it)
        if r.verdict and r.verdict.get("refused"):
            console.print(Text(f"{r.task_id}: {r.answer}", style="red"), soft_wrap=True)
        elif r.infra_error:  # whole, on one line: the table's cell wraps it (a refused E2B template says why there)
            console.print(Text(f"{r.task_id}: {r.infra_error}", style="red"), soft_wrap=True)
    if failed:
        raise LooplineError(f"{len(failed)} of {len(results)} task(s) did not score {expected:g}")


def main() -> None:
    run_cli(app)


if __name__ == "__main__":  # pragma: no cover
    main()
