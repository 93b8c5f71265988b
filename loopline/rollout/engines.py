"""Engines built by name: the run config's `engine.kind` is a name registered in `ENGINES`, so adding an engine
touches its own module and nothing else (`ENGINES.register("name")(EngineKind(build, in_process))`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from loopline.registry import Registry
from loopline.rollout.engine_thread import EngineThread


@dataclass(frozen=True)
class EngineRequest:
    """What the run asks of its engine: serve `version`, whose weights are at `weights`."""

    settings: Any  # the run config's `engine:` section (config.EngineSettings)
    weights: str
    version: int
    initial: Path  # the run's initial weights (a LoRA run's servers keep them as the base)
    concurrency: int
    log_dir: Path  # launched servers' logs
    tag: str | None = None  # the run's, in every weight version a server is given (no other run's weights pass as ours)
    lora: Any = None  # the learner's LoRA config when versions ship as adapters (sglang only)


@dataclass(frozen=True)
class EngineKind:
    build: Callable[[EngineRequest], EngineThread]
    # Serves from the learner's own process: a weight sync hands over the learner's tensors and a version
    # needs no file. Otherwise another process loads each version from disk (every version is exported).
    in_process: bool


def _local(request: EngineRequest) -> EngineThread:
    from loopline.rollout.local_engine import LocalEngine

    return EngineThread(LocalEngine(request.weights, version=request.version, max_batch=request.concurrency))


def lora_server_args(lora: Any) -> tuple[str, ...]:
    """SGLang's flags for serving adapters of this rank on these modules (peft's all-linear is SGLang's all).
    (No --max-loaded-loras: it must be at least --max-loras-per-batch, 8 by default, or the server refuses to
    start; the client unloads all but the two newest adapters itself.)"""
    modules = ["all"] if lora.target_modules == "all-linear" else list(lora.target_modules)
    return ("--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *modules)


def _sglang(request: EngineRequest) -> EngineThread:
    """launch: replicas started here on the weights (logs in `log_dir`), stopped when the engine shuts down.
    servers: a client of running servers; each is asked what it serves, and one serving other weights is
    brought to the version by the next weight sync. With `lora` the servers keep `initial` and load each
    version's adapter; launched ones are started with LoRA enabled for its rank and modules."""
    from loopline.rollout.sglang_engine import SGLangEngine
    from loopline.rollout.weights import read_layout

    settings, lora = request.settings, request.lora
    if settings.launch is not None:
        from loopline.rollout.sglang_launch import LaunchedSGLang, LaunchPlan

        launch = settings.launch
        args = tuple(launch.args) + (lora_server_args(lora) if lora is not None and "--enable-lora" not in launch.args else ())
        plan = LaunchPlan(launch.replicas, args, launch.module, launch.python, launch.startup_timeout_s)
        return EngineThread(LaunchedSGLang(
            plan, request.log_dir, request.weights, request.version, str(request.initial), timeout_s=settings.timeout_s,
            tag=request.tag, adapters=lora is not None,
        ))
    client = SGLangEngine(
        settings.servers, initial_version=request.version, timeout_s=settings.timeout_s,
        initial_path=str(request.initial if lora else request.weights), served_layout=read_layout(request.initial),
        tag=request.tag, adapters=lora is not None,
    )
    engine = EngineThread(client)
    try:
        engine.call(client.refresh_versions(), timeout_s=60)
    except BaseException:
        engine.shutdown()
        raise
    return engine


ENGINES: Registry[EngineKind] = Registry("engine", "engine.kind", ())
ENGINES.register("local")(EngineKind(_local, in_process=True))  # LocalEngine in this process (CPU)
ENGINES.register("sglang")(EngineKind(_sglang, in_process=False))
