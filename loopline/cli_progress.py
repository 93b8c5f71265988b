"""Live progress in the CLI: a run's bar fed by the ledger (what is committed, not what is hoped), and a
bar for any long step before it (a starter build, a model pull, an image build)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from loopline import activity
from loopline.cli_support import console
from loopline.store import db as store_db
from loopline.store import ledger, queries
from loopline.store.errors import is_outage


def _describe(p: queries.RunProgress, rate: float) -> str:
    parts = [f"v{p.policy_version}"]
    if p.reward_mean is not None:
        parts.append(f"reward {p.reward_mean:.2f}")
    if p.eval_success is not None:
        parts.append(f"eval {p.eval_success:.0%} (v{p.eval_version})")
    if p.version_lag_mean is not None:
        parts.append(f"lag {p.version_lag_mean:.1f}")
    parts.append(f"{rate:.1f} traj/s")
    parts += [f"{name} {done}/{total}" for name, (done, total) in activity.snapshot().items()]  # e.g. an evaluation
    return " · ".join(parts)


def _wait(stop: threading.Event, seconds: float) -> bool:
    """Waits up to `seconds`, less when an activity (an evaluation) begins or ends: one shorter than a poll
    would otherwise never reach the bar. True when `stop` is set."""
    began, deadline = activity.snapshot().keys(), time.monotonic() + seconds
    while not stop.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline or activity.snapshot().keys() != began:
            return False
    return True


@contextlib.contextmanager
def follow_run(name: str, steps: int, every_s: float = 1.0) -> Iterator[None]:
    """Show step, reward, eval success, version lag and throughput of run `name` while the body trains it."""
    stop = threading.Event()
    progress = Progress(
        TextColumn("[bold]{task.fields[run]}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=console, transient=False, redirect_stdout=False, redirect_stderr=False,
    )
    bar = progress.add_task("starting", total=steps, run=name)

    def poll() -> None:
        engine = store_db.make_engine()
        first: tuple[float, int] | None = None
        unreachable_since: float | None = None
        said: dict[str, int] = {}
        while True:
            stopping = _wait(stop, every_s)  # (then one last look: the bar ends on the run's last step and evaluation)
            try:
                with store_db.session(engine) as s:
                    run_id = ledger.get_run(s, name).id
                    now = queries.run_progress(s, run_id)
            except Exception as exc:  # the run is not created yet, or the ledger is out of reach (the run waits it out)
                if is_outage(exc):
                    unreachable_since = unreachable_since or time.monotonic()
                    progress.update(bar, description=f"ledger unreachable, retrying ({time.monotonic() - unreachable_since:.0f} s)")
                if stopping:
                    break
                continue
            unreachable_since = None
            first = first or (time.monotonic(), now.trajectories)
            elapsed = time.monotonic() - first[0]
            rate = (now.trajectories - first[1]) / elapsed if elapsed > 0 else 0.0
            progress.update(bar, completed=now.learner_step, description=_describe(now, rate), refresh=True)
            if now.eval_version is not None and now.eval_version != said.get("eval"):  # one line per evaluation
                said["eval"] = now.eval_version
                progress.console.print(f"  v{now.eval_version}: held-out success {now.eval_success:.1%}")
            if stopping:
                break
        engine.dispose()

    watcher = threading.Thread(target=poll, name="loopline-progress", daemon=True)
    with progress:
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join(timeout=5)


@contextlib.contextmanager
def step_progress(title: str) -> Iterator[Callable[[str, int, int], None]]:
    """Yields `update(description, completed, total)` (total 0: no known end) for a step that may take minutes."""
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, redirect_stdout=False, redirect_stderr=False,
    )
    with progress:
        bar = progress.add_task(title, total=None)

        def update(description: str, completed: int, total: int) -> None:
            progress.update(bar, description=description, completed=completed, total=total or None)

        yield update
