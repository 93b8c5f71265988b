"""One run assembly: what `train`, `learner`, `rollout_worker` and `evaluate` build from a run's config.

Each component is built by name from the run config (torchtitan's `build_*` style), so a process
that joins a run - a worker on another machine, an evaluation a week later - builds exactly what
the trainer built: the environment version the ledger pinned, the chat format of the run's
initial policy, the sampling settings and the engine the config names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
from sqlalchemy.engine import Engine as Database
from sqlmodel import Session

from loopline import holder
from loopline.envregistry import registry
from loopline.envregistry.spec import EnvSpec
from loopline.envregistry.tasks import Task
from loopline.errors import LooplineError
from loopline.config import EngineSettings, RunConfig
from loopline.pipeline.resumption import FORKED_FROM, run_config  # noqa: F401 (re-exported)
from loopline.rollout.harness import agent_program
from loopline.rollout.harness.actions import tool_schemas
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import SamplingParams
from loopline.rollout.engines.thread import EngineThread
from loopline.rollout.engines.registry import ENGINES, EngineRequest
from loopline.rollout.harness.episode import EpisodeSetup
from loopline.rollout.harness.scheduler import Binding
from loopline.rollout.weights.server import WeightServer, address_toward
from loopline.rollout.weights.store import WeightStore
from loopline.store import db as store_db
from loopline.store import ledger, migrate
from loopline.store.records import ResumeState
from loopline.store.uris import TRAINER, WeightsURI
from loopline.pipeline import stages
from loopline.trainer import ranks
from loopline.trainer.config import LoraConfig
from loopline.trainer.learner import Learner


log = logging.getLogger(__name__)


@dataclass
class RunParts:
    """A run as the ledger knows it, with its environment and episode setup (no engine, no learner)."""

    config: RunConfig
    database: Database
    run_id: uuid.UUID
    env_name: str
    env_version: int
    spec: EnvSpec
    tasks: list[Task]
    initial: Path  # version 0's weights on this host: the tokenizer and the served model's tensor layout come from here
    state: ResumeState
    weights: WeightStore  # every version's URI to a directory on this host (fetched from the trainer when it must be)

    def session(self) -> Session:
        """A session on the run's ledger (use as `with parts.session() as s`)."""
        return store_db.session(self.database)

    def session_factory(self) -> Callable[[], Session]:
        database = self.database
        return lambda: store_db.session(database)

    def train_tasks(self) -> dict[str, Task]:
        return {t.id: t for t in self.tasks if t.split == "train"}

    def eval_tasks(self) -> list[Task]:
        """The fixed eval split: the environment's first `eval.tasks` eval tasks."""
        return [t for t in self.tasks if t.split == "eval"][: self.config.eval.tasks]

    def setup(self) -> EpisodeSetup:
        return build_setup(self.config, self.spec, self.env_version, self.initial)

    def held_out(self, setup: EpisodeSetup | None = None, session_factory: Callable[[], Session] | None = None) -> stages.HeldOut:
        """The run's held-out evaluation (with the setup and sessions of a loop already built, where there is one)."""
        config = self.config
        return stages.HeldOut(
            self.run_id, setup or self.setup(), session_factory or self.session_factory(), self.eval_tasks(), self.env_version,
            config.eval.temperature, config.eval.seed, config.rollout.concurrency, config.rollout.max_attempts,
        )

    def workdir(self) -> Path:
        return store_db.loopline_home() / "runs" / self.config.name


def weight_store(run: str, database: Database, store: str = TRAINER) -> WeightStore:
    """This process's way to run `run`'s weights: published to `store` (the config's `weights.store`), fetched into
    this host's cache (LOOPLINE_HOME/cache/weights) from wherever each URI says."""

    def lookup(run: str) -> tuple[str, str] | None:
        with store_db.session(database) as s:
            return ledger.weight_server(s, run)

    return WeightStore(run, store_db.loopline_home() / "cache" / "weights", lookup, store=store)


@contextlib.contextmanager
def serving_weights(config: RunConfig, run_id: uuid.UUID, database: Database, weights: WeightStore) -> Iterator[WeightServer]:
    """The run's weight server, for as long as this process drives the run: the directories the run's versions
    name (and every one `weights` publishes from now on), to holders of the token recorded in the ledger."""

    def published() -> list[Path]:
        with store_db.session(database) as s:
            uris = ledger.published_uris(s, run_id) + [ledger.initial_weights(s, run_id)]
        return [Path(u.path) for u in map(WeightsURI.parse, uris) if u.scheme == TRAINER and u.run == config.name]

    host = config.weights.advertise or address_toward(database.url.host or "127.0.0.1")
    server = WeightServer(host, config.weights.port, published).start()
    weights.serve = server.allow
    try:
        with store_db.session(database) as s:
            ledger.record_weight_server(s, run_id, server.url, server.token, holder.this_process())
        log.info("run %s: serving its weights to other hosts at %s", config.name, server.url)
        yield server
    finally:
        weights.serve = None
        server.stop()


def open_run(config: RunConfig, run_id: uuid.UUID, database: Database | None = None, weights: WeightStore | None = None) -> RunParts:
    """The parts of a run that exists in the ledger (its environment is the registered version it pinned); its
    version 0 is fetched to this host if it is not here."""
    database = database or migrate.open_ledger()
    with store_db.session(database) as s:
        row = registry.get(s, config.env)
        env = (row.name, row.version, registry.spec_of(row), registry.tasks_of(row))  # before a rollback expires the row
        state = ledger.resume_state(s, run_id)
        initial_uri = ledger.initial_weights(s, run_id)
    weights = weights or weight_store(config.name, database, config.weights.store)
    weights.pinned.add(initial_uri)
    return RunParts(config, database, run_id, *env, weights.local(initial_uri), state, weights)


def open_named_run(run: str) -> RunParts:
    """A run of the ledger, by name or id, with the config it stored: what a process joining it builds on
    (a rollout worker, an evaluation, a replay)."""
    config, _ = run_config(None, run)
    database = migrate.open_ledger()
    with store_db.session(database) as s:
        run_id = ledger.get_run(s, run).id
    return open_run(config, run_id, database)


def build_setup(config: RunConfig, spec: EnvSpec, env_version: int, initial: Path) -> EpisodeSetup:
    sampling = SamplingParams(
        temperature=config.rollout.sampling.temperature, top_p=config.rollout.sampling.top_p, top_k=config.rollout.sampling.top_k,
        max_new_tokens=config.rollout.sampling.max_new_tokens,
    )
    chat = ChatFormat.for_policy(initial)
    if config.rollout.few_shot is not None:
        chat = replace(chat, few_shot=tuple(turn.model_dump() for turn in config.rollout.few_shot))
    if spec.tool_calls == "hermes":
        try:
            chat = chat.with_tools(tool_schemas(spec.tools))
        except ValueError as exc:
            raise LooplineError(f"policy {config.policy} with env {spec.name} (tool_calls: hermes): {exc}") from None
    agent_program.check_reachable(spec)
    return EpisodeSetup(spec, env_version, chat, sampling)


def build_binding(parts: RunParts) -> Binding:
    return Binding(parts.setup(), parts.train_tasks())


def build_engine(
    settings: EngineSettings, weights: str, version: int, initial: Path, concurrency: int, log_dir: Path, tag: str | None = None,
    lora: LoraConfig | None = None,
) -> EngineThread:
    """The engine the config names (`rollout/engines/registry.ENGINES`), serving `version` (whose weights are at
    `weights`), on its own loop thread."""
    return ENGINES[settings.kind].build(EngineRequest(settings, weights, version, initial, concurrency, log_dir, tag, lora))


def build_run_engine(parts: RunParts, weights: str, version: int, concurrency: int | None = None, adapters: bool = False) -> EngineThread:
    """The run's engine serving `version` from `weights` (its URI); `adapters` (a LoRA run's rollouts on SGLang, not an
    evaluation of an exported version): the servers keep the base and load adapters from the ledger."""
    return build_engine(
        parts.config.engine, str(parts.weights.local(weights)), version, parts.initial, concurrency or parts.config.rollout.concurrency, parts.workdir() / "sglang",
        tag=parts.run_id.hex[:8], lora=parts.config.learner.lora if adapters and parts.config.syncs_adapters else None,
    )


def export_restored(parts: RunParts, learner: Learner, version: int) -> str:
    """Export `version`, which its commit did not write to disk, from the learner restored to it (checkpoint
    plus replay; `resume_learner` checked and recorded its digest), and record where it is."""
    target = learner.export_weights(parts.workdir() / "weights" / f"v{version:06d}.{os.getpid()}")  # (its own: see stages.learn)
    uri = parts.weights.publish(target)
    with parts.session() as s:
        ledger.record_export(s, parts.run_id, version, uri)
    return uri


def build_learner(parts: RunParts) -> Learner | None:
    """The learner at the run's last committed step (newest full checkpoint, then the steps since replayed).
    None when the run has no step left to train (no DeepSpeed start)."""
    state = parts.state
    if state.next_learner_step > parts.config.steps:
        return None
    newest = state.last_checkpoint.uri if state.last_checkpoint is not None else None
    return resume_learner(parts, newest or None, state.next_learner_step - 1)


def resume_learner(parts: RunParts, checkpoint: str | Path | None, through_step: int) -> Learner:
    """`restore_learner`, checked against the sha256 that step's commit recorded. On CPU the rebuild is exact
    (no kernel of the learner depends on thread scheduling, the replay uses the recorded thread count). Where it cannot be
    (a GPU's kernels, a machine that cannot give the recorded thread count) a rebuild that differs must not
    strand the run: it goes on from the rebuilt weights, the ledger records their digest (`weight_rebuild`),
    and one line says so."""
    learner = restore_learner(parts, checkpoint, through_step)
    with parts.session() as s:
        recorded = ledger.version_weights(s, parts.run_id, through_step).sha256
    digest = learner.weights_sha256()
    if recorded is not None and digest != recorded:
        with parts.session() as s:
            if digest in ledger.rebuilt_digests(s, parts.run_id, through_step):
                return learner  # the weights an earlier rebuild made, which the run went on from
        threads = torch.get_num_threads() if learner.device.type == "cpu" else None
        with parts.session() as s:
            ledger.record_rebuild(s, parts.run_id, through_step, digest, recorded, learner.device.type, threads)
        log.warning(
            "run %s v%d: the weights rebuilt from the last checkpoint and the recorded batches (sha256 %s…) differ from "
            "those its commit recorded (%s…; not bit-exact on %s); continuing from the rebuilt weights, recorded in the ledger",
            parts.config.name, through_step, digest[:12], recorded[:12], learner.device.type,
        )
    return learner


def restore_learner(
    parts: RunParts, checkpoint: str | Path | None, through_step: int, after_each: Callable[[Learner, int], None] | None = None
) -> Learner:
    """A learner as it was after learner step `through_step`: the full checkpoint given (else the run's
    initial weights), then the recorded batches of the steps after the checkpoint's own step, replayed
    (`after_each(learner, step)` after each)."""
    config = parts.config
    learner = ranks.build_learner(parts.initial, config.learner_config())
    restored = 0
    if checkpoint:
        step = learner.load_checkpoint(checkpoint).get("cursor", {}).get("learner_step")
        if step is None:
            raise LooplineError(f"{checkpoint}: the checkpoint does not say which learner step it holds")
        restored = int(step)
    stages.replay(learner, parts.session_factory(), parts.run_id, range(restored + 1, through_step + 1), after_each)
    return learner
