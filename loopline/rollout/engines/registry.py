"""Engines built by name: the run config's `engine.kind` is a name registered in `ENGINES`, so adding an engine
touches its own module and nothing else: `ENGINES.register("name", settings=MySettings)(EngineKind(build,
in_process))`, where MySettings (an `EngineSettings` with the engine's own fields) validates its `engine:`
section and reaches `build` as `request.settings`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import Field, model_validator

from loopline.registry import Registry, RegistryName, RegistrySection, Settings
from loopline.rollout.engines.base import SGLANG_REQUEST_TIMEOUT_S, SGLANG_STARTUP_TIMEOUT_S
from loopline.rollout.engines.thread import EngineThread


ENGINES: Registry[EngineKind] = Registry("engine", "engine.kind", ())


class EngineSettings(Settings):
    """Where rollouts and evaluations are generated: the built-in CPU engine, SGLang, or an engine of your own.
    An engine's own settings subclass this; what the rest of loopline asks of any engine is below."""

    kind: Annotated[str, RegistryName(ENGINES)] = Field(
        "local", description="local: the built-in CPU engine in the training process; sglang: SGLang servers (its settings "
        "below); or an engine registered in rollout/engines.ENGINES",
    )

    @property
    def in_process(self) -> bool:
        """The engine serves from the learner's process (weight syncs from memory, no file per version)."""
        return ENGINES[self.kind].in_process

    @property
    def running_servers(self) -> list[str]:
        """Servers the run connects to rather than starts: checked before the run opens, and unable to load an
        older version for an evaluation that is owed."""
        return []

    @property
    def ships_adapters(self) -> bool:
        """With learner.lora, each version reaches the engine as its adapter alone (the engine keeps the base)."""
        return False


class LaunchSettings(Settings):
    """SGLang servers loopline starts for the run (on this machine), stops at its end and restarts if they die."""

    replicas: int = Field(1, ge=1, description="servers to start (each a full copy of the model; requests are spread over them)")
    args: list[str] = Field(default_factory=list, description="extra arguments to the server, e.g. [--mem-fraction-static, '0.6']")
    module: str = Field("sglang.launch_server", description="the server's Python module (python -m MODULE --model-path ... --port ...)")
    python: str | None = Field(None, description="the interpreter that has SGLang installed (default: this one)")
    startup_timeout_s: float = Field(SGLANG_STARTUP_TIMEOUT_S, gt=0, description="how long a server may take to answer its health check after it starts")


class SGLangSettings(EngineSettings):
    """SGLang servers: started for the run (`launch`) or already running (`servers`)."""

    servers: list[str] = Field(default_factory=list, description="connect to these servers (replicas or one router)")
    launch: LaunchSettings | None = Field(None, description="start the servers for the run")
    timeout_s: float = Field(SGLANG_REQUEST_TIMEOUT_S, gt=0, description="the longest one request may take")
    lora_sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="with learner.lora: each version ships as its adapter alone (the servers keep the base model; "
        "started with --enable-lora) or as the merged model",
    )

    @property
    def running_servers(self) -> list[str]:
        return self.servers

    @property
    def ships_adapters(self) -> bool:
        return self.lora_sync == "adapter"

    @model_validator(mode="after")
    def _one_source(self) -> "SGLangSettings":
        if bool(self.servers) == (self.launch is not None):
            raise ValueError("kind: sglang needs exactly one of servers: [URL, ...] (connect) or launch: {...} (start them)")
        for url in self.servers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"server {url!r}: expected an http:// or https:// URL")
        return self


@dataclass(frozen=True)
class EngineRequest:
    """What the run asks of its engine: serve `version`, whose weights are at `weights`."""

    settings: Any  # the run config's `engine:` section: the engine's own settings (an EngineSettings)
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
    from loopline.rollout.engines.local import LocalEngine

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
    from loopline.rollout.engines.sglang import SGLangEngine
    from loopline.rollout.weights.check import read_layout

    settings, lora = request.settings, request.lora
    if settings.launch is not None:
        from loopline.rollout.engines.sglang_launch import LaunchedSGLang, LaunchPlan

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


ENGINES.register("local")(EngineKind(_local, in_process=True))  # LocalEngine in this process (CPU)
ENGINES.register("sglang", settings=SGLangSettings)(EngineKind(_sglang, in_process=False))
ENGINE_SECTION = RegistrySection(ENGINES)  # (the run config's `engine:`)
