"""SGLang servers started by loopline for a run: launched, health-checked, revived, stopped.

`LaunchedSGLang` is an Engine: an `SGLangEngine` client over replicas this process started with
`python -m sglang.launch_server --model-path W --host 127.0.0.1 --port P ARGS...`. Each replica's
log goes to the run directory; each dies with this process (PR_SET_PDEATHSIG), so a killed trainer
leaves no server behind. When a request or a weight update fails and a replica's process is gone (a
real server dies on a bad weights file, or runs out of memory), the replica is restarted on the
last version every replica loaded successfully, and the call still fails as an `EngineError`: the
attempt is retried as an infra failure and the next weight sync brings the replica up to date.
With `adapters` (a LoRA run) every replica starts on the run's initial model with LoRA enabled, and
a revived one loads the last good adapter again before it serves.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import httpx

from loopline.holder import die_with_parent
from loopline.rollout.engines.base import SGLANG_REQUEST_TIMEOUT_S, SGLANG_STARTUP_TIMEOUT_S, EngineError, Generation, InFlightPolicy, SamplingParams, WeightsSource
from loopline.rollout.engines.sglang import SGLangEngine
from loopline.rollout.weights.check import read_layout
from loopline.ports import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchPlan:
    replicas: int = 1
    args: tuple[str, ...] = ()
    module: str = "sglang.launch_server"
    python: str | None = None
    startup_timeout_s: float = SGLANG_STARTUP_TIMEOUT_S


@dataclass
class _Server:
    index: int
    port: int
    log_path: Path
    process: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class LaunchedSGLang:
    def __init__(
        self, plan: LaunchPlan, log_dir: Path, weights: str, version: int, initial_path: str, timeout_s: float = SGLANG_REQUEST_TIMEOUT_S,
        tag: str | None = None, adapters: bool = False,
    ):
        self.plan = plan
        log_dir.mkdir(parents=True, exist_ok=True)
        self.servers = [_Server(i, free_port(), log_dir / f"sglang-{i}.log") for i in range(plan.replicas)]
        self.adapters = adapters
        self.base = (0, str(initial_path)) if adapters else (version, str(weights))  # what a replica starts on
        # the newest version every replica loaded (with adapters: its adapter; none is loaded yet)
        self.good = self.base if adapters else (version, str(weights))
        self._reviving: asyncio.Lock | None = None  # made on the engine's loop
        self.client = SGLangEngine(
            [s.url for s in self.servers], initial_version=version, timeout_s=timeout_s, initial_path=self.base[1],
            served_layout=read_layout(initial_path), tag=tag, adapters=adapters,
        )
        for server in self.servers:
            self._spawn(server)
        try:
            for server in self.servers:
                self._wait_healthy(server)
        except BaseException:
            self.stop()
            raise

    # ------------------------------------------------------------------ processes

    def _spawn(self, server: _Server) -> None:
        version, weights = self.base if self.adapters else self.good
        command = [
            self.plan.python or sys.executable, "-m", self.plan.module, "--model-path", weights,
            "--host", "127.0.0.1", "--port", str(server.port), "--weight-version", self.client.label(version), *self.plan.args,
        ]
        with open(server.log_path, "ab") as out:
            out.write(f"\n--- loopline: starting replica {server.index} on v{version}: {' '.join(command)}\n".encode())
            out.flush()
            server.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent(),
            )
        replica = self.client.replicas[server.index]
        replica.version, replica.default_version, replica.default_path = version, version, weights

    def _wait_healthy(self, server: _Server) -> None:
        deadline = time.monotonic() + self.plan.startup_timeout_s
        while True:
            if not server.alive():
                raise EngineError(f"SGLang replica {server.index} exited while starting (log {server.log_path}): {self._tail(server)}")
            try:
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"SGLang replica {server.index} not healthy after {self.plan.startup_timeout_s:g} s (log {server.log_path})")
            time.sleep(0.5)

    @staticmethod
    def _tail(server: _Server) -> str:
        try:
            return server.log_path.read_text(errors="replace")[-600:]
        except OSError:
            return ""

    def _dead_after(self, grace_s: float) -> list[_Server]:
        """The replicas that are gone, waiting up to `grace_s` for one to go: a server that dropped a
        connection may still be exiting."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [s for s in self.servers if not s.alive()]
            if dead or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)

    async def _revive_dead(self, grace_s: float = 2.0) -> list[int]:
        """Restart every replica whose process is gone, on the last good version; returns their indices.
        Concurrent failures revive a replica once (the lock; a revived replica is alive again)."""
        if self._reviving is None:
            self._reviving = asyncio.Lock()
        async with self._reviving:
            dead = await asyncio.to_thread(self._dead_after, grace_s)
            for server in dead:
                log.warning("SGLang replica %d died (log %s); restarting it on v%d", server.index, server.log_path, self.good[0])
                server.restarts += 1
                self._spawn(server)
            for server in dead:
                await asyncio.to_thread(self._wait_healthy, server)
                version, adapter = self.good
                if self.adapters and version > 0:
                    replica = self.client.replicas[server.index]
                    await self.client.load_adapter(replica, self.client.label(version), adapter)
                    replica.version = version
        return [s.index for s in dead]

    # ------------------------------------------------------------------ Engine

    def version(self) -> int:
        return self.client.version()

    def server_urls(self) -> list[str]:
        return self.client.server_urls()

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> Generation:
        try:
            return await self.client.generate(prompt_ids, sampling, request_id)
        except EngineError:
            await self._revive_dead()
            raise

    async def update_weights(self, version: int, weights: WeightsSource, in_flight: InFlightPolicy = "finish") -> dict[str, float]:
        try:
            timings = await self.client.update_weights(version, weights, in_flight)
        except EngineError as exc:
            revived = await self._revive_dead()
            if revived:
                raise EngineError(f"{exc}; replicas {revived} died and were restarted on v{self.good[0]}") from None
            raise
        self.good = (version, str(weights))
        return timings

    async def refresh_versions(self) -> list[int]:
        return await self.client.refresh_versions()

    async def close(self) -> None:
        await self.client.close()
        await asyncio.to_thread(self.stop)

    def stop(self) -> None:
        for server in self.servers:
            if server.process is not None and server.alive():
                server.process.terminate()
        for server in self.servers:
            if server.process is None:
                continue
            try:
                server.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()
