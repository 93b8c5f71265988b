"""Experiment trackers (TRL's `report_to`, verl's `trainer.logger`): the numbers the ledger holds, sent on.

The ledger stays the record; a tracker is a view for the tools people already run. After each learner step
every metric the ledger holds for it (reward, loss, grad norm, clip fraction, KL, version lag, the step's
time parts, tokens/s, peak memory) goes to each tracker at that step; each evaluation's held-out success at
the step of its version (`eval/success_rate`); the run config as parameters once; at the end of the run its
newest exported model as an artifact where the tracker keeps artifacts (MLflow, W&B). A resumed run goes on
in the same tracker run. A tracker that fails (not installed, its server down) is switched off with one
warning line: the run never fails for it.

Where they write: TensorBoard under the run's directory (`runs/NAME/tensorboard`); MLflow to
MLFLOW_TRACKING_URI (default: `runs/NAME/mlruns`), experiment `loopline`; W&B offline unless WANDB_API_KEY or
WANDB_MODE says otherwise (files under `runs/NAME/wandb`; `wandb sync` uploads them); trackio to its own
local store (TRACKIO_DIR), project `loopline`.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Protocol

log = logging.getLogger(__name__)


class Tracker(Protocol):
    """Built with the run's name, id, directory and config (recorded as its parameters)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def artifact(self, directory: Path) -> None: ...

    def close(self) -> None: ...


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config as `a.b: value` strings (MLflow's and TensorBoard's parameters are flat)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return out


class TensorBoard:
    def __init__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(workdir / "tensorboard"))
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in _flat(config).items()), 0)

    def log(self, step, metrics):
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def artifact(self, directory):
        pass  # TensorBoard keeps no artifacts

    def close(self):
        self.writer.close()


class MLflow:
    """Through `MlflowClient` (no global active run: the flow's threads share nothing). The tracker run is
    found again by its tag `loopline.run_id`, so a resume goes on in it."""

    def __init__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (workdir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name("loopline")
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment("loopline")
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`loopline.run_id` = '{run_id}'", max_results=1)
        if found:
            self.run = found[0].info.run_id
            self.client.update_run(self.run, status="RUNNING")
        else:
            self.run = self.client.create_run(experiment_id, tags={"loopline.run_id": str(run_id)}, run_name=name).info.run_id
        existing = self.client.get_run(self.run).data.params
        fresh = {k: v[:6000] for k, v in _flat(config).items() if k not in existing}  # (a param cannot change once logged)
        for key, value in fresh.items():
            self.client.log_param(self.run, key, value)

    def log(self, step, metrics):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run, metrics=[Metric(name, value, now, step) for name, value in metrics.items()])

    def artifact(self, directory):
        self.client.log_artifacts(self.run, str(directory), artifact_path="model")

    def close(self):
        self.client.set_terminated(self.run)


class Wandb:
    def __init__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any]):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        (workdir / "wandb").mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(
            project="loopline", name=name, id=run_id.hex, resume="allow", dir=str(workdir), mode=mode, reinit="create_new", config=config,
        )

    def log(self, step, metrics):
        self.run.log(metrics, step=step)

    def artifact(self, directory):
        artifact = self.wandb.Artifact("model", type="model")
        artifact.add_dir(str(directory))
        self.run.log_artifact(artifact)

    def close(self):
        self.run.finish()


class Trackio:
    def __init__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any]):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project="loopline", name=name, resume="allow", config=config, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step, metrics):
        self.trackio.log(metrics, step=step)

    def artifact(self, directory):
        pass  # (metrics only: the model stays in the run's directory)

    def close(self):
        self.trackio.finish()


TRACKERS: dict[str, Callable[[str, uuid.UUID, Path, dict[str, Any]], Tracker]] = {
    "tensorboard": TensorBoard, "mlflow": MLflow, "wandb": Wandb, "trackio": Trackio,
}


class Trackers:
    """The trackers a run names, each called so that its failure is one warning and the end of that tracker."""

    def __init__(
        self, names: list[str], run_name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any],
        warn: Callable[[str], None] | None = None,
    ):
        self.warn = warn or log.warning
        self.active: dict[str, Tracker] = {}
        for name in names:
            try:
                self.active[name] = TRACKERS[name](run_name, run_id, workdir, config)
            except Exception as exc:  # noqa: BLE001 - a tracker must never fail the run
                self._failed(name, "could not start", exc)

    def _failed(self, name: str, doing: str, exc: BaseException) -> None:
        hint = " (pip install it)" if isinstance(exc, ImportError) else ""
        self.warn(f"tracker {name} {doing} ({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}){hint}; "
                  "the run goes on without it")
        self.active.pop(name, None)

    def _each(self, doing: str, call: Callable[[Tracker], None]) -> None:
        for name, tracker in list(self.active.items()):
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001
                self._failed(name, doing, exc)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        if metrics:
            self._each(f"failed at step {step}", lambda t: t.log(step, metrics))

    def evaluation(self, version: int, success: float, tasks: int) -> None:
        self._each(f"failed to record v{version}'s evaluation", lambda t: t.log(version, {"eval/success_rate": success, "eval/tasks": float(tasks)}))

    def artifact(self, directory: Path | None) -> None:
        if directory is not None and directory.is_dir():
            self._each("failed to store the model", lambda t: t.artifact(directory))

    def close(self) -> None:
        self._each("failed to close", lambda t: t.close())
        self.active.clear()
