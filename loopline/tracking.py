"""Experiment trackers (TRL's `report_to`, verl's `trainer.logger`): the numbers the ledger holds, sent on.

The ledger stays the record; a tracker is a view for the tools people already run. After each learner step
every metric the ledger holds for it (reward, loss, grad norm, clip fraction, KL, version lag, the step's
time parts, peak memory, and as verl names them response_length/mean and /max, perf/tokens_per_s) goes to each tracker at that step; each evaluation's held-out success at
the step of its version (`eval/success_rate`); the run config as parameters once; at the end of the run its
newest exported model as an artifact where the tracker keeps artifacts (MLflow, W&B). A resumed run goes on
in the same tracker run, and each tracker first gets what it lacks (`Trackers`). A tracker that fails (not
installed, its server down) is one warning line and is tried again later: the run never waits or fails for it.

Where they write: TensorBoard under the run's directory (`runs/NAME/tensorboard`); MLflow to
MLFLOW_TRACKING_URI (default: a SQLite store, `runs/NAME/mlflow.db`), experiment `loopline` (its `experiment` setting); W&B offline unless WANDB_API_KEY or
WANDB_MODE says otherwise (files under `runs/NAME/wandb`; `wandb sync` uploads them); trackio to its own
local store (TRACKIO_DIR), project `loopline`, run `NAME-ID8` (the run's id's first 8 hex digits); W&B's and trackio's `project` settings say another.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from sqlmodel import Session

from loopline.config import TRACKERS, MLflowSettings, Tracker, TrackerSettings, TrackioSettings, WandbSettings, tracker_settings  # noqa: F401 (re-exported)
from loopline.store import queries

log = logging.getLogger(__name__)


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config as `a.b: value` strings (MLflow's and TensorBoard's parameters are flat)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


EVALUATION_KEYS = ("eval/success_rate", "eval/tasks", "timing_s/eval")  # what an evaluation sends, at its version's step


def _last_held(rows: Iterable[tuple[int, Iterable[str]]]) -> tuple[int, int]:
    """(last learner step, last evaluated version) among a tracker's (step, metric names) rows."""
    trained, evaluated = 0, -1
    for step, names in rows:
        names = set(names)
        if names - set(EVALUATION_KEYS):
            trained = max(trained, step)
        if "eval/success_rate" in names:
            evaluated = max(evaluated, step)
    return trained, evaluated


class TensorBoard:
    def __init__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any], settings: TrackerSettings):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = workdir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.directory))
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in _flat(config).items()), 0)

    def holds(self) -> tuple[int, int]:
        """What its event files hold (a crash between a send and the run's note of it sent that step twice)."""
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        return _last_held(
            (event.step, [v.tag for v in event.summary.value if v.metadata.plugin_data.plugin_name == "scalars"])
            for path in self.directory.glob("events.out.tfevents.*") for event in EventFileLoader(str(path)).Load()
        )

    def log(self, step, metrics):
        """A step as one event (one record: a SIGKILL leaves all of it or a torn tail the reader skips). A scalar
        each, as `add_scalar` writes them, left part of a step, which `holds` then took as sent whole."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import scalar

        values = [value for name, number in metrics.items() for value in scalar(name, number).value]
        self.writer._get_file_writer().add_summary(Summary(value=values), step)  # (SummaryWriter has no public call for several scalars)
        self.writer.flush()

    def artifact(self, directory):
        pass  # TensorBoard keeps no artifacts

    def close(self):
        self.writer.close()


MLFLOW_PARAMS_PER_BATCH = 100  # MLflow's limit on the parameters of one log_batch


class MLflow:
    """Through `MlflowClient` (no global active run: the flow's threads share nothing). The tracker run is
    found again by its tag `loopline.run_id`, so a resume goes on in it."""

    def __init__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any], settings: MLflowSettings):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # A server that is down is found out in seconds, not after mlflow's default 7 retries over 2 minutes each
        # (its trackers' thread would hold the end of the run; the user's own settings win)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        # Default: a SQLite store in the run's directory (`mlflow ui --backend-store-uri sqlite:///.../mlflow.db`):
        # mlflow 3 refuses its old default, the ./mlruns file store ("in maintenance mode"), and nothing was logged.
        workdir.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{_created_whole(workdir / 'mlflow.db')}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        artifacts = None if os.environ.get("MLFLOW_TRACKING_URI") else (workdir / "mlartifacts").resolve().as_uri()
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.experiment, artifact_location=artifacts)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`loopline.run_id` = '{run_id}'", max_results=1)
        if found:
            self.run = found[0].info.run_id
            self.client.update_run(self.run, status="RUNNING")
        else:
            self.run = self.client.create_run(experiment_id, tags={"loopline.run_id": str(run_id)}, run_name=name).info.run_id
        existing = self.client.get_run(self.run).data.params
        fresh = [Param(k, v[:6000]) for k, v in _flat(config).items() if k not in existing]  # (a param cannot change once logged)
        for start in range(0, len(fresh), MLFLOW_PARAMS_PER_BATCH):  # (one request per 100, not one each: 63 took a busy start minutes)
            self.client.log_batch(self.run, params=fresh[start : start + MLFLOW_PARAMS_PER_BATCH])

    def holds(self) -> tuple[int, int]:
        """What the store holds (each step is one `log_batch`: all of it or none), not the run's note of it."""
        names = self.client.get_run(self.run).data.metrics
        return _last_held((m.step, [name]) for name in names for m in self.client.get_metric_history(self.run, name))

    def log(self, step, metrics):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run, metrics=[Metric(name, value, now, step) for name, value in metrics.items()])

    def artifact(self, directory):
        self.client.log_artifacts(self.run, str(directory), artifact_path="model")

    def close(self):
        self.client.set_terminated(self.run)


def _created_whole(store: Path) -> Path:
    """MLflow's SQLite store, created (and migrated: seconds on a busy machine) under another name and linked into
    place only when whole: a SIGKILL in its migrations left a store no later start could open ("table secrets
    already exists"), and MLflow lost the run for good."""
    store = store.resolve()
    if not store.exists():
        from mlflow.tracking import MlflowClient

        partial = store.with_name(f"{store.name}.{os.getpid()}.{threading.get_ident()}.partial")
        partial.unlink(missing_ok=True)
        MlflowClient(tracking_uri=f"sqlite:///{partial}").search_experiments(max_results=1)
        try:
            os.link(partial, store)
        except FileExistsError:  # (another process made it first: theirs is whole too)
            pass
        except OSError:  # (a filesystem without hard links)
            if not store.exists():
                os.replace(partial, store)
        partial.unlink(missing_ok=True)
    return store


class Wandb:
    def __init__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any], settings: WandbSettings):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        (workdir / "wandb").mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(
            project=settings.project, entity=settings.entity, name=name, id=run_id.hex, resume="allow", dir=str(workdir), mode=mode, reinit="create_new", config=config,
            settings=wandb.Settings(console="off"),  # (its copy of the terminal duplicated loopline's log)
        )

    def log(self, step, metrics):
        self.run.log(metrics, step=step)

    def holds(self) -> tuple[int, int]:
        """W&B keeps a step's row in its service process until the next step or `finish`: a SIGKILL lost every row
        logged in the 5 s before it (offline), so a step is held only once its row is in a file (offline: this
        run's files, every attempt's) or on the server (online: the step a resume goes on from)."""
        if self.run.offline:
            runs = Path(self.run.dir).parents[1]  # (RUNS/offline-run-TIME-ID/files)
            files = runs.glob(f"offline-run-*-{self.run.id}/run-{self.run.id}.wandb")
            return _last_held((row["_step"], row) for path in files for row in wandb_rows(path))
        last = self.run.step - 1  # (a row holds its step's metrics and then its version's evaluation: see _catch_up)
        return max(last, 0), last

    def artifact(self, directory):
        artifact = self.wandb.Artifact("model", type="model")
        artifact.add_dir(str(directory))
        self.run.log_artifact(artifact)

    def close(self):
        self.run.finish()


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf `Record`s of a W&B run file. wandb ships no reader: the file is LevelDB's log format after a
    7-byte ":W&B" header (32 KiB blocks of records, each with a 7-byte header: crc, length, type FULL / FIRST /
    MIDDLE / LAST). A torn tail (its writer killed) ends the reading."""
    from wandb.proto import wandb_internal_pb2

    data, block, pending, pos = path.read_bytes(), 32768, b"", 7
    if data[:4] != b":W&B":
        return
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):
            return
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record
        elif kind == 0:
            pending = b""


def wandb_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The history rows of a W&B run file, each {metric name: value} with its `_step`. (wandb-core names an item
    by `nested_key` parts, the Python SDK by `key`.)"""
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            yield {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}


def trackio_run_name(name: str, run_id: uuid.UUID) -> str:
    """trackio finds a run by its name alone: a run deleted and trained again under the same name went on in the old
    one's (every point twice, some with the old values). Its id makes the name the run's own; a resume keeps it."""
    return f"{name}-{run_id.hex[:8]}"


class Trackio:
    def __init__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any], settings: TrackioSettings):
        import trackio

        self.trackio = trackio
        self.project, self.name = settings.project, trackio_run_name(name, run_id)
        self.run = trackio.init(project=self.project, name=self.name, resume="allow", config=config, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step, metrics):
        self.trackio.log(metrics, step=step)

    def holds(self) -> tuple[int, int]:
        """trackio writes its store from a thread, in batches: a SIGKILL lost the last step sent. What its store holds
        (a row per `log`: a step's metrics, or an evaluation)."""
        from trackio.sqlite_storage import SQLiteStorage

        return _last_held((row["step"], set(row) - {"step", "timestamp"}) for row in SQLiteStorage.get_logs(self.project, self.name))

    def artifact(self, directory):
        pass  # (metrics only: the model stays in the run's directory)

    def close(self):
        self.trackio.finish()


# a tracker is a class (or function) (run name, run id, run directory, config, its settings) -> Tracker, registered by name
# in whatever module defines it; `tracking:` in a run config names it
for _name, _tracker in {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": Wandb, "trackio": Trackio}.items():
    TRACKERS.register(_name)(_tracker)
TRACKERS.check_implemented()


STUCK_S = 5.0  # a tracker's call this long at the end of a run is taken as stuck (a server gone): the rest waits
STARTING_S = 30.0  # the same for starting a tracker (imports and a first request) and closing it (W&B's `finish` writes its rows)
FLUSH_MAX_S = 60.0  # at most this long at the end of a run for the trackers to catch up; the rest waits for the next start
RETRY_S = 60.0  # a tracker that failed is started again after this long, from the step it had reached
MARKS_FILE = "trackers.json"  # in the run's directory: the last step and evaluated version each tracker holds


class Trackers:
    """Each tracker a run names, kept up to date with the ledger from a thread of its own.

    The ledger is the record; a tracker is a projection of it. Nothing is handed to a tracker: its thread
    reads what it lacks (the steps after the last it holds, the evaluations after the last version) from the
    ledger and sends it in order, so a step committed just before a crash reaches the trackers on the next
    start, none twice. A tracker that is slow or down holds up neither training nor the other trackers (an
    MLflow server killed mid-run froze a run for 4 minutes; one that was never up blocked it before step 1):
    the run only wakes the threads. A failing tracker is one warning; it is started again after RETRY_S and
    catches up. At the end they get the time to catch up and close unless stuck (`close`); what they did not
    send waits for the next start. What each holds is noted in the run's directory (MARKS_FILE) after each
    send: a crash between a send and its note sends that step again. (Evaluations are sent by version, as the
    run makes them: in version order.)"""

    def __init__(
        self, entries: list[str | TrackerSettings], run_name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any],
        session_factory: Callable[[], Session], warn: Callable[[str], None] | None = None,
    ):
        self.run_id, self.workdir = run_id, workdir
        self._marks_lock = threading.Lock()
        marks = self._read_marks()
        trackers = [tracker_settings(entry) for entry in entries]
        self.projections = [
            _Projection(self, t.kind, lambda t=t: TRACKERS[t.kind](run_name, run_id, workdir, config, t), session_factory,
                        warn or log.warning, **marks.get(t.kind, {}))
            for t in trackers
        ]
        for projection in self.projections:
            projection.thread.start()

    @property
    def active(self) -> bool:
        return bool(self.projections)

    def wake(self) -> None:
        """A step or an evaluation was committed: the trackers catch up (never waited for)."""
        for projection in self.projections:
            projection.wake.set()

    def artifact(self, directory: Path | None) -> None:
        """The run's newest model, for the trackers that keep artifacts: sent as they close."""
        if directory is not None and directory.is_dir():
            for projection in self.projections:
                projection.artifact = directory

    def close(self) -> None:
        """Wait while the trackers catch up (a healthy one sends a step in milliseconds, but starting MLflow or
        W&B beside the others took 11 s on 2 busy cores): until each is done, or each left is stuck in one call
        (STUCK_S; STARTING_S for a start or a close), or at most FLUSH_MAX_S. What a stuck one did not send waits for the
        run's next start."""
        deadline = time.monotonic() + FLUSH_MAX_S
        for projection in self.projections:
            projection.closing.set()
            projection.wake.set()
        while alive := [p for p in self.projections if p.thread.is_alive()]:
            now = time.monotonic()
            if now > deadline or all(p.stuck(now) for p in alive):
                for projection in alive:  # (each stops at its next step: a later start sends the rest, in order)
                    projection.abandoned = True
                    projection.warn(f"tracker {projection.name} did not answer in time; what it lacks is sent when the run next starts")
                break
            time.sleep(0.05)
        self.projections = []

    def _read_marks(self) -> dict[str, dict[str, int]]:
        try:
            saved = json.loads((self.workdir / MARKS_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return saved.get("marks", {}) if saved.get("run_id") == str(self.run_id) else {}  # (a deleted run's name reused)

    def write_marks(self) -> None:
        with self._marks_lock:
            marks = {p.name: {"step": p.step, "version": p.version} for p in self.projections}
            self.workdir.mkdir(parents=True, exist_ok=True)
            staging = self.workdir / f"{MARKS_FILE}.{os.getpid()}.{threading.get_ident()}"
            staging.write_text(json.dumps({"run_id": str(self.run_id), "marks": marks}))
            os.replace(staging, self.workdir / MARKS_FILE)


class _Projection:
    """One tracker and its thread: what it holds (`step`, `version`), brought up to date with the ledger."""

    def __init__(
        self, owner: Trackers, name: str, start: Callable[[], Tracker], session_factory: Callable[[], Session],
        warn: Callable[[str], None], step: int = 0, version: int = -1,
    ):
        self.owner, self.name, self.start, self.session_factory, self.warn = owner, name, start, session_factory, warn
        self.step, self.version = step, version  # the last learner step it holds (and each before); the last evaluated version
        self.tracker: Tracker | None = None
        self.retry_at, self.failing = 0.0, False  # (failing: warned about, not yet back)
        self.artifact: Path | None = None
        self.wake, self.closing = threading.Event(), threading.Event()
        self.abandoned = False  # (stuck at the end of its run: left behind)
        self.calling: tuple[float, float] | None = None  # (since, allowance) of the call under way
        self.wake.set()  # (a resume: what the last attempt did not send)
        self.thread = threading.Thread(target=self._work, name=f"loopline-tracker-{name}", daemon=True)

    def _work(self) -> None:
        while True:
            self.wake.wait(timeout=RETRY_S)
            self.wake.clear()
            closing = self.closing.is_set()
            self._catch_up()
            if closing or self.abandoned:
                break
        if self.tracker is not None and not self.abandoned:
            if self.artifact is not None:
                self._call("failed to store the model", lambda t: t.artifact(self.artifact))
            self._call("failed to close", lambda t: t.close(), allowance=STARTING_S)

    def _catch_up(self) -> None:
        if self.tracker is None:
            if time.monotonic() < self.retry_at:
                return
            try:
                with self._timed(STARTING_S):
                    tracker = self.start()
                    if (holds := getattr(tracker, "holds", None)) is not None:  # (its own store, over the marks: see Tracker)
                        self.step, self.version = holds()
                    self.tracker = tracker
            except Exception as exc:  # noqa: BLE001 - a tracker must never fail the run
                self._failed("could not start", exc)
                return
        try:
            with self.session_factory() as s:
                steps = queries.metrics_after(s, self.owner.run_id, self.step)
                evaluations = [e for e in queries.eval_results(s, self.owner.run_id) if e.version > self.version]
        except Exception as exc:  # noqa: BLE001 - the ledger out of reach (the loop says so): tried at the next wake
            log.debug("tracker %s: the ledger could not be read (%s)", self.name, exc)
            return
        # in step order, an evaluation at its version's step after that step's metrics (W&B drops a step older
        # than the last it got: the v0 evaluation sent after step 2 was lost)
        sends = [(step, 0, metrics) for step, metrics in steps.items()]
        sends += [(e.version, 1, {k: v for k, v in zip(EVALUATION_KEYS, (e.success, float(e.tasks), e.seconds)) if v is not None}) for e in evaluations]
        for step, is_eval, metrics in sorted(sends, key=lambda send: send[:2]):
            doing = f"failed to record v{step}'s evaluation" if is_eval else f"failed at step {step}"
            if not self._call(doing, lambda t: t.log(step, metrics)):
                return
            self._holds(**{"version" if is_eval else "step": step})
        if self.failing:
            self.failing = False
            self.warn(f"tracker {self.name} is back: it holds every step to {self.step}")

    @contextlib.contextmanager
    def _timed(self, allowance: float) -> Iterator[None]:
        self.calling = (time.monotonic(), allowance)
        try:
            yield
        finally:
            self.calling = None

    def stuck(self, now: float) -> bool:
        """Whether its call under way has run past what a healthy tracker takes."""
        calling = self.calling
        return calling is not None and now - calling[0] > calling[1]

    def _holds(self, step: int | None = None, version: int | None = None) -> None:
        if self.abandoned:
            return  # (its run has gone on without it: the marks are no longer its to write)
        self.step, self.version = step if step is not None else self.step, version if version is not None else self.version
        self.owner.write_marks()

    def _call(self, doing: str, call: Callable[[Tracker], None], allowance: float = STUCK_S) -> bool:
        if self.abandoned:
            return False
        try:
            with self._timed(allowance):
                call(self.tracker)
            return True
        except Exception as exc:  # noqa: BLE001
            self._failed(doing, exc)
            with contextlib.suppress(Exception):
                self.tracker.close()
            self.tracker = None
            return False

    def _failed(self, doing: str, exc: BaseException) -> None:
        self.retry_at = time.monotonic() + RETRY_S
        if self.failing:
            return  # (one warning until it is back)
        self.failing = True
        hint = " (pip install it)" if isinstance(exc, ImportError) else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.warn(f"tracker {self.name} {doing} ({type(exc).__name__}: {first}){hint}; the run goes on without it and "
                  f"tries it again every {RETRY_S:g} s")
