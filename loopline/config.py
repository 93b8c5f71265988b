"""The run config: a YAML file validated up front, so a bad value fails before any work starts."""

from __future__ import annotations

import difflib
import logging
import math
import re
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import yaml
from pydantic import BaseModel, Field, ValidationError, field_serializer, field_validator, model_validator

from loopline import plugins
from loopline.errors import LooplineError
from loopline.registry import Registry, RegistryName, RegistrySection, Settings
from loopline.yamlfile import line_index, read_text, read_yaml
from loopline.rollout.engines.base import InFlightPolicy
from loopline.rollout.engines.registry import ENGINE_SECTION, EngineSettings, LaunchSettings, SGLangSettings  # (no torch either)
from loopline.types import LEASE_SECONDS, MAX_ATTEMPTS
from loopline.trainer.config import (  # noqa: F401 (re-exported: the run config's learner section; no torch, a config is checked before it loads)
    ADVANTAGE_SECTION, LEARNER_SECTION, LOSS_SECTION, AdvantageSettings, DeepSpeedSettings, LearnerConfig, LearnerSettings, LoraConfig,
    LossSettings, RankLaunch,
)



MAX_STEPS = 1_000_000  # a policy version is a 32-bit integer in the ledger; a million steps is years of training

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}")


def run_name(name: str) -> str:
    """A run's name is a directory under the loopline home (its log, checkpoints, weights) and an argument of
    every command: no path separator, nothing that climbs out of it, nothing a shell would split."""
    if not RUN_NAME.fullmatch(name):
        raise ValueError(f"{name[:120]!r} is not a run name: 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return name


class Tracker(Protocol):
    """One experiment tracker's side of a run: the ledger's metrics projected onto it, step by step.

    A step counts as held once `log` returns, unless the tracker also has `holds() -> (last learner step, last
    evaluated version)`: what its own store holds durably, read when it starts (a tracker that buffers, as W&B and
    trackio do, loses what a SIGKILL caught in its buffer; the resume sends that again)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def artifact(self, directory: Path) -> None: ...

    def close(self) -> None: ...


class OpenTracker(Protocol):
    """`tracking: [name]`: the run's name, id, directory and config (recorded as its parameters), and the tracker's
    settings (`{kind: wandb, project: P}`) -> its Tracker."""

    def __call__(self, name: str, run_id: uuid.UUID, workdir: Path, config: dict[str, Any], settings: TrackerSettings, /) -> Tracker: ...


# the built-ins are tracking.py's
TRACKERS: Registry[OpenTracker] = Registry("tracker", "tracking", ("tensorboard", "mlflow", "wandb", "trackio"))


class TrackerSettings(Settings):
    """One entry of `tracking:`, a name or `{kind: NAME, ...}`; a tracker's own settings subclass this."""

    kind: Annotated[str, RegistryName(TRACKERS)] = Field(description="the tracker")


class MLflowSettings(TrackerSettings):
    experiment: str = Field("loopline", min_length=1, description="the MLflow experiment the run is logged under (made if missing)")


class WandbSettings(TrackerSettings):
    project: str = Field("loopline", min_length=1, description="the W&B project")
    entity: str | None = Field(None, description="the W&B team or user; default: the API key's")


class TrackioSettings(TrackerSettings):
    project: str = Field("loopline", min_length=1, description="the trackio project")


TRACKERS.declare_settings("mlflow", MLflowSettings)
TRACKERS.declare_settings("wandb", WandbSettings)
TRACKERS.declare_settings("trackio", TrackioSettings)
TRACKER_SECTION = RegistrySection(TRACKERS)


def tracker_settings(entry: str | dict | TrackerSettings) -> TrackerSettings:
    """One `tracking:` entry (a name: its defaults) as its tracker's settings."""
    return TRACKER_SECTION.validate(TrackerSettings, {"kind": entry} if isinstance(entry, str) else entry)  # type: ignore[return-value]

log = logging.getLogger(__name__)


class SamplingConfig(Settings):
    temperature: float = Field(1.0, ge=0.0, description="rollout sampling temperature (the learner divides its logits by the same; 0: greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; the recorded logprobs stay the full distribution's (as verl)")
    top_k: int = Field(0, ge=0, description="sample among the k likeliest tokens; 0: all")
    max_new_tokens: int = Field(48, ge=1, description="the most tokens one model call may generate (an episode's total is the env's budgets.max_generated_tokens)")


class EvalSettings(Settings):
    every: int = Field(4, ge=1, description="evaluate every N learner steps (and before the first)")
    tasks: int = Field(100, ge=1, description="held-out tasks an evaluation plays (the first N of the env's eval split)")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature of evaluations (0: greedy)")
    seed: int = Field(1234, ge=0, le=2**31 - 1, description="seed of an evaluation's sampling: each version plays the same draws")


class ChatTurn(Settings):
    role: Literal["system", "user", "assistant", "tool"] = Field(description="who says it (tool: a tool's output, for a template that renders tool messages)")
    content: str = Field(description="what is said, as the chat template renders it")


class WeightsSettings(Settings):
    """How each version's weights reach the hosts that load them (rollout workers, the hosts of SGLang servers).
    Not part of the run's identity: a resume may change it (versions published before keep their URIs)."""

    store: str = Field(
        "trainer", description="trainer: the trainer's host serves them over HTTP (its address and a per-run token are in the "
        "ledger); file:///DIR: a filesystem every host mounts at DIR; s3://BUCKET/PREFIX or another fsspec URL: an object store",
    )
    advertise: str | None = Field(None, description="the address other hosts reach the trainer's weight server at; default: this host's address on its route to the ledger")
    port: int = Field(0, ge=0, le=65535, description="the trainer's weight server's port; 0: a free one (the ledger records it)")

    @field_validator("store")
    @classmethod
    def _a_store(cls, value: str) -> str:
        if value != "trainer" and "://" not in value:
            raise ValueError(f"{value!r}: use trainer, file:///A/SHARED/DIR, or an object store URL such as s3://BUCKET/PREFIX")
        if value.startswith("file://") and not value.removeprefix("file://").startswith("/"):
            raise ValueError(f"{value!r}: a file:// store needs an absolute path (file:///mnt/shared/loopline)")
        return value


class RolloutSettings(Settings):
    """How the learner's batches are generated: their size, the loop's shape, what a failed episode costs."""

    mode: Literal["sync", "async"] = Field("sync", description="sync: rollout, learn, sync in lock-step; async: rollouts overlap learning")
    groups_per_step: int = Field(32, ge=1, description="tasks per learner step (TRL's prompts per step; verl's train_batch_size)")
    group_size: int = Field(8, ge=1, description="episodes per task, compared with each other for the advantage (TRL's num_generations; verl's rollout.n)")
    concurrency: int = Field(32, ge=1, description="episodes in flight at once (the engine's batch)")
    sampling: SamplingConfig = Field(SamplingConfig(), description="how rollouts are sampled")
    few_shot: list[ChatTurn] | None = Field(
        None, description="demonstration turns before every task's prompt (they teach a small model the env's tool syntax); "
        "unset: the policy's own (its loopline_prompt.json, e.g. smollm2-135m's calculator demonstrations); []: none",
    )
    max_staleness: int = Field(
        1, ge=0, description="async: train nothing generated more than this many versions before the version being trained"
    )
    local_rollout: bool = Field(
        True, description="async: generate in the training process too; false leaves it to `loopline worker RUN` processes"
    )
    workers: int = Field(
        0, ge=0, description="async with local_rollout: false: rollout_worker flow runs the train flow submits through its "
        "deployment (`loopline deploy --pool`) and keeps running; 0: start `loopline worker RUN` yourself",
    )
    in_flight: InFlightPolicy = Field(
        "finish", description="at a weight sync, requests in flight finish on the old weights, are aborted, or continue on the new"
    )
    max_attempts: int = Field(MAX_ATTEMPTS, ge=1, description="attempts of an episode that fails for an infrastructure reason before its group is given up")
    lease_seconds: float = Field(LEASE_SECONDS, gt=0, description="a dead worker's slots are retried after this long (and a silent trainer is taken for dead)")

    @field_validator("group_size")
    @classmethod
    def _groups_need_two_samples(cls, value: int) -> int:
        if value < 2:
            raise ValueError("group advantages (GRPO, Dr. GRPO, RLOO) compare samples of one task: at least 2")
        return value

    @property
    def staleness_bound(self) -> int | None:
        """How many versions a trained group may lag (async's max_staleness); None: sync, each step's groups are its own."""
        return self.max_staleness if self.mode == "async" else None

    @model_validator(mode="after")
    def _deployed_workers_feed_an_async_learner(self) -> "RolloutSettings":
        if self.workers and (self.mode != "async" or self.local_rollout):
            raise ValueError("workers: deployed workers feed an async learner: set mode: async and local_rollout: false")
        return self


class RunConfig(Settings):
    # (first: pydantic validates fields in order, so the modules are imported before any name they register is checked)
    imports: list[str] = Field(
        default_factory=list, description="Python modules imported first, in every process of the run (the CLI, learner ranks, "
        "rollout workers): your components register their names there (`@POLICY_LOSSES.register(\"mine\")`). Each must be "
        "importable wherever the run has a process (pip install, or PYTHONPATH); LOOPLINE_IMPORTS adds modules for every command",
    )
    name: str = Field(description="the run's name in the ledger (`loopline train` again resumes it): 1-100 letters, digits, '.', '_' or '-'")
    env: str = Field(description="environment YAML (relative to this file) or a registered NAME@VERSION")
    policy: str = Field("tiny", description="tiny (shipped for the quickstart env, else built on first use), smollm2-135m (pulled), or a model directory")
    steps: int = Field(8, ge=1, le=MAX_STEPS, description="learner steps (policy versions) to train")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seeds the task order, sampling and the learner")
    rollout: RolloutSettings = Field(RolloutSettings(), description="the batches: their size, sync or async, sampling, failed episodes")
    learner: Annotated[LearnerSettings, LEARNER_SECTION] = Field(
        DeepSpeedSettings(), description="the learner: optimizer, loss, advantage, then its backend's own settings (precision, ranks)",
    )
    eval: EvalSettings = Field(EvalSettings(), description="held-out evaluations during the run")
    engine: Annotated[EngineSettings, ENGINE_SECTION] = Field(
        EngineSettings(), description="where rollouts and evaluations are generated: `kind`, then that engine's own settings",
    )
    weights: WeightsSettings = Field(WeightsSettings(), description="how each version's weights reach other hosts")

    tracking: list[Annotated[TrackerSettings, TRACKER_SECTION]] = Field(
        default_factory=list, description="experiment trackers that also get the ledger's numbers (TRL's report_to, verl's "
        "trainer.logger), each a name or {kind: NAME, its settings} ({kind: wandb, project: P}); not part of the run's "
        "identity: a resume may change them",
        json_schema_extra=lambda schema: schema["items"]["anyOf"].insert(0, {"type": "string", "enum": list(TRACKERS.names)}),  # (a name alone)
    )

    @model_validator(mode="before")
    @classmethod
    def _read_earlier_layouts(cls, data: object) -> object:
        return _component_fields_upgraded(flat_layout_upgraded(data)[0])

    @field_validator("imports")
    @classmethod
    def _import_first(cls, modules: list[str]) -> list[str]:
        plugins.load(modules)
        return modules

    @field_validator("name")
    @classmethod
    def _a_run_name(cls, name: str) -> str:
        return run_name(name)

    @field_validator("tracking", mode="before")
    @classmethod
    def _names_are_sections(cls, value: object) -> object:
        return [{"kind": entry} if isinstance(entry, str) else entry for entry in value] if isinstance(value, list) else value

    @field_validator("tracking")
    @classmethod
    def _each_tracker_once(cls, value: list[TrackerSettings]) -> list[TrackerSettings]:
        kinds = [entry.kind for entry in dict.fromkeys(value)]
        if twice := next((kind for kind in kinds if kinds.count(kind) > 1), None):
            raise ValueError(f"{twice} is named twice with different settings; keep one")
        return list(dict.fromkeys(value))

    @field_serializer("tracking")
    def _names_where_defaults(self, value: list[TrackerSettings]) -> list:
        """A tracker at its defaults is written as its name (as configs were before trackers had settings)."""
        return [entry.kind if entry.model_dump(exclude_defaults=True) == {"kind": entry.kind} else entry.model_dump() for entry in value]

    @model_validator(mode="after")
    def _warmup_within_the_run(self) -> "RunConfig":
        optimizer_steps = self.steps * self.learner.minibatches  # (warm-up step s trains at (s + 1) / warmup_steps of lr)
        if self.learner.warmup_steps > optimizer_steps:
            raise ValueError(f"learner.warmup_steps: {self.learner.warmup_steps} is more than the run's {optimizer_steps} optimizer steps "
                             "(steps x learner.minibatches): the learning rate would never reach lr; lower it")
        return self

    @model_validator(mode="after")
    def _every_version_on_disk_for_other_processes(self) -> "RunConfig":
        every = self.learner.export_every
        if every not in (None, 1) and self.versions_loaded_elsewhere:
            where = f"the {self.engine.kind} servers load" if not self.engine.in_process else "rollout workers (local_rollout: false) load"
            raise ValueError(f"learner.export_every: {every}: {where} every version from disk; leave it unset or set 1")
        return self

    @property
    def syncs_adapters(self) -> bool:
        """A LoRA run on SGLang that ships each version as its adapter (the servers keep the base model)."""
        return self.learner.lora is not None and self.engine.ships_adapters

    @property
    def versions_loaded_elsewhere(self) -> bool:
        """Whether a process other than the learner's loads each new version's full weights from disk (with
        adapter sync the servers and workers load adapters, which are written for every version anyway)."""
        if self.syncs_adapters:
            return False
        return not self.engine.in_process or (self.rollout.mode == "async" and not self.rollout.local_rollout)

    @property
    def exports_every(self) -> int:
        if self.learner.export_every is not None:
            return self.learner.export_every
        return 1 if self.versions_loaded_elsewhere else self.learner.checkpoint_every

    def evaluates(self, version: int) -> bool:
        """Version v is trained by learner step v: evaluate before the first step, every `eval.every`, and the last."""
        return version == 0 or version % self.eval.every == 0 or version == self.steps

    def exports(self, version: int) -> bool:
        """Whether version `version`'s weights are written to disk: what an evaluation, a fork, a later
        `loopline eval` or another process may load. The others live in the learner's memory only."""
        return version % self.exports_every == 0 or self.evaluates(version)

    def learner_config(self) -> LearnerConfig:
        """What the learner is built with: the `learner:` section, and what the trainer derives from the rest of the run."""
        learner = self.learner
        return LearnerConfig.model_validate(dict(learner) | dict(
            loss=learner.loss.for_run(max_new_tokens=self.rollout.sampling.max_new_tokens), temperature=self.rollout.sampling.temperature,
            seed=self.seed, decay_steps=self.steps * learner.minibatches if learner.lr_schedule != "constant" else None,
        ))

    @property
    def env_is_file(self) -> bool:
        return self.env.endswith((".yaml", ".yml"))


# The layout before sections: these settings stood at the top level (`rollout_workers` is now `rollout.workers`).
# Stored configs of earlier runs and older files are read through it, so they resume and compare unchanged.
FLAT_ROLLOUT = {
    "mode": "mode", "max_staleness": "max_staleness", "local_rollout": "local_rollout", "rollout_workers": "workers",
    "in_flight": "in_flight", "groups_per_step": "groups_per_step", "group_size": "group_size", "concurrency": "concurrency",
    "max_attempts": "max_attempts", "lease_seconds": "lease_seconds", "sampling": "sampling", "few_shot": "few_shot",
}


def flat_layout_upgraded(data: object) -> tuple[object, dict[str, str]]:
    """`data` with the flat layout's settings moved under `rollout:`, and which moved (old name -> new path)."""
    if not isinstance(data, dict) or not (flat := [k for k in FLAT_ROLLOUT if k in data]):
        return data, {}
    rollout = {} if data.get("rollout") is None else data["rollout"]
    if not isinstance(rollout, dict):
        return data, {}  # (the section's own error says what is wrong)
    if both := [k for k in flat if FLAT_ROLLOUT[k] in rollout]:
        raise ValueError(f"{both[0]} is set twice: at the top level (the layout before sections) and as rollout.{FLAT_ROLLOUT[both[0]]}; keep the second")
    moved = {k: f"rollout.{FLAT_ROLLOUT[k]}" for k in flat}
    upgraded = {k: v for k, v in data.items() if k not in moved}
    upgraded["rollout"] = {**rollout, **{FLAT_ROLLOUT[k]: data[k] for k in flat}}
    return upgraded, moved


# Before components had settings of their own, a run's stored config held every engine's, learner backend's, loss
# component's and estimator's fields whatever it chose (the others' at their defaults): they are dropped there, so
# that such a run resumes (its stored config reads as the same config).
_SHARED_DEFAULTS: dict[tuple[str, ...], tuple[RegistrySection, type[BaseModel], dict[str, Any]]] = {  # path -> (its section, base, moved fields' defaults)
    ("engine",): (ENGINE_SECTION, EngineSettings, {name: SGLangSettings.model_fields[name].get_default(call_default_factory=True)
                                                  for name in ("servers", "launch", "timeout_s", "lora_sync")}),
    ("learner",): (LEARNER_SECTION, LearnerSettings, {name: DeepSpeedSettings.model_fields[name].get_default() for name in ("zero_stage", "dtype", "launch")}),
    ("learner", "loss"): (LOSS_SECTION, LossSettings, {"clip_ratio_c": 3.0, "correction_bounds": "upper", "norm_length": None}),
    ("learner", "advantage"): (ADVANTAGE_SECTION, AdvantageSettings, {"std": "sample", "eps": 1e-6}),
}


def _component_fields_upgraded(data: object) -> object:
    def upgraded(values: object, path: tuple[str, ...]) -> object:
        if not isinstance(values, dict):
            return values
        found = _SHARED_DEFAULTS.get(path)
        within = found[0].stored_read(found[1], values, found[2]) if found else values
        return {k: upgraded(v, (*path, k)) if any(p[: len(path) + 1] == (*path, k) for p in _SHARED_DEFAULTS) else v for k, v in within.items()}

    return upgraded(data, ())


MAX_CONFIG_BYTES = 1 << 20  # a run config is settings; a 50 MB one took 84 s to refuse


def parse_config(data: object, where: str, lines: dict[tuple, int] | None = None, *, note_old_layout: bool = False) -> RunConfig:
    """`data` validated as a run config, or one line per problem: where (file:line), the field, what is wrong.
    The layout before sections is read too (`note_old_layout`: say where each of its settings goes now)."""
    if not isinstance(data, dict):
        raise LooplineError(f"{where}: expected a mapping of run settings (name, env, policy, steps, ...)")
    lines = dict(lines or {})
    try:
        data, moved = flat_layout_upgraded(data)
    except ValueError as exc:
        raise LooplineError(f"invalid run config\n{where}: {exc}") from None
    for old, new in moved.items():  # (a problem in a moved setting is still reported at its line)
        lines.update({tuple(new.split(".")) + path[1:]: line for path, line in list(lines.items()) if path[:1] == (old,)})
    if moved and note_old_layout:
        log.warning("%s: %s: the layout before sections, read as %s; move them under rollout:", where, ", ".join(moved), ", ".join(moved.values()))
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise LooplineError("invalid run config\n" + "\n".join(_problem(e, where, lines) for e in exc.errors())) from None
    if (path := _non_finite(config.model_dump())) is not None:  # (the learner's dataclass sections too)
        raise LooplineError(f"invalid run config\n{where}: {path}: must be a finite number")
    return config


def _problem(error, where: str, lines: dict[tuple, int]) -> str:
    path = tuple(error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if (named := re.match(r"([\w.]+): (.*)", message, re.S)) and named[1].split(".")[0] in RunConfig.model_fields:  # (a check of several settings names the one to change)
        path, message = (*path, *named[1].split(".")), named[2]
    probe = path
    while probe and probe not in lines:
        probe = probe[:-1]
    at = f"{where}:{lines[probe]}" if probe in lines else where
    if error["type"] in ("extra_forbidden", "unexpected_keyword_argument") and path:
        homes = sorted((section for section, names in _sections().items() if path[-1] in names), key=lambda home: home.split(" ")[0] != path[0])  # (its own section's first)
        close = difflib.get_close_matches(str(path[-1]), sorted({n for names in _sections().values() for n in names}), n=1)
        if homes:  # a setting of another section (`lr` under rollout:), or of another component
            message = f"not a setting here; it is one of {_homes(homes)}"
        else:
            message = "unknown setting" + (f"; did you mean {close[0]}?" if close else "")
    return f"{at}: {'.'.join(str(p) for p in path) or '(top level)'}: {message}"


def _homes(homes: list[str]) -> str:
    """`learner.loss (correction: mis)`, `learner.loss (correction: rejection)` -> `learner.loss (correction: mis / rejection)`."""
    grouped: dict[str, list[str]] = {}
    for home in homes:
        where, _, name = home.rstrip(")").rpartition(": ") if home.endswith(")") else (home, "", "")
        grouped.setdefault(where, []).append(name)
    return " and ".join(f"{where}: {' / '.join(names)})" if names != [""] else where for where, names in grouped.items())


def _sections() -> dict[str, set[str]]:
    """Each section's setting names, by where they go (for "did you mean", and "it is one of learner"); a section's
    components' own settings under `PATH (KEY: NAME)`."""
    models: dict[str, type[BaseModel]] = {"(top level)": RunConfig, "rollout": RolloutSettings, "rollout.sampling": SamplingConfig,
                                          "learner.launch": RankLaunch, "engine.launch": LaunchSettings, "eval": EvalSettings, "weights": WeightsSettings}
    sections = {path: set(model.model_fields) for path, model in models.items()}
    for path, (section, base, _) in _SHARED_DEFAULTS.items():
        sections[".".join(path)] = set(base.model_fields)
        for key, registry in section.registries.items():
            sections |= {f"{'.'.join(path)} ({key}: {name})": set(model.model_fields) - set(base.model_fields)
                         for name, model in registry.settings_models(base).items() if model is not base}
    sections["learner.lora"] = set(LoraConfig.model_fields)
    sections |= {f"tracking (kind: {name})": set(model.model_fields) - {"kind"}
                 for name, model in TRACKERS.settings_models(TrackerSettings).items() if model is not TrackerSettings}
    return sections


def _non_finite(value: object, path: str = "") -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(top level)"
    if isinstance(value, dict):
        return next((p for k, v in value.items() if (p := _non_finite(v, f"{path}.{k}" if path else str(k))) is not None), None)
    if isinstance(value, (list, tuple)):
        return next((p for i, v in enumerate(value) if (p := _non_finite(v, f"{path}[{i}]")) is not None), None)
    return None


def load_config(path: str | Path) -> tuple[RunConfig, Path]:
    """The validated config and the directory its relative paths start from."""
    file = Path(path)
    if not file.is_file():
        raise LooplineError(f"{file}: no such run config")
    data, node = read_yaml(read_text(file, MAX_CONFIG_BYTES, "a run config"), file, "a run config is settings, not data")
    config = parse_config(data, str(file), line_index(node) if node is not None else None, note_old_layout=True)
    if config.env_is_file and not (file.parent / config.env).is_file():
        raise LooplineError(f"{file}: env: {config.env} not found (a YAML path is relative to the run config)")
    return config, file.parent


def config_file(config: str | Path | dict | RunConfig | None, directory: Path) -> str | None:
    """A run config given from Python as a dict or a RunConfig, written as a file under `directory` (the flows
    pass a path on: to the learner's ranks, to a resume); relative env and policy paths are taken from the
    current directory and written absolute. A path is returned as it is."""
    if config is None or isinstance(config, (str, Path)):
        return None if config is None else str(config)
    parsed = config if isinstance(config, RunConfig) else parse_config(config, "train(config=...)")
    data = parsed.model_dump(mode="json")
    if parsed.env_is_file:
        data["env"] = str(Path(parsed.env).resolve())
        if not Path(data["env"]).is_file():
            raise LooplineError(f"train(config=...): env: {parsed.env} not found (a path is relative to the current directory here)")
    if Path(parsed.policy).is_dir():
        data["policy"] = str(Path(parsed.policy).resolve())
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{parsed.name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)
