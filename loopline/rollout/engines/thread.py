"""EngineThread: one engine shared by callers on different event loops.

An engine belongs to the event loop that first drove it (LocalEngine's decode loop, SGLangEngine's
HTTP client). The training flows call it from several threads at once: the rollout worker, the
evaluation and the weight sync each run as a Prefect task with its own loop. This proxy owns a
loop in a daemon thread, runs the engine there, and forwards every call to it, so all callers see
one engine, one batch and one version.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Coroutine, Sequence, TypeVar

from loopline.rollout.engines.base import Engine, EngineClosed, Generation, InFlightPolicy, SamplingParams, WeightsSource

T = TypeVar("T")


class EngineThread:
    def __init__(self, engine: Engine):
        self.inner = engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loopline-engine", daemon=True)
        self._thread.start()

    async def _call(self, coro: Coroutine[object, object, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise EngineClosed("the engine was shut down")
        # a cancelled caller cancels the call on the engine's loop too (wrap_future propagates it)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> Generation:
        return await self._call(self.inner.generate(prompt_ids, sampling, request_id))

    async def update_weights(self, version: int, weights: WeightsSource, in_flight: InFlightPolicy = "finish") -> dict[str, float] | None:
        return await self._call(self.inner.update_weights(version, weights, in_flight))

    def release_memory(self, weights: bool = False) -> None:
        """The engine drops what it keeps only to generate faster, and with `weights` its weights until the next
        update (`LocalEngine.release_memory`), from a plain thread; an engine without it (a server elsewhere) has
        nothing of this process's to drop."""
        release = getattr(self.inner, "release_memory", None)
        if release is not None and self._loop.is_running():
            self.call(release(weights), timeout_s=30)

    def call(self, coro: Coroutine[object, object, T], timeout_s: float | None = None) -> T:
        """Run a coroutine of the engine (e.g. SGLangEngine.refresh_versions) on its loop, from a plain thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout_s)

    def version(self) -> int:
        return self.inner.version()

    def server_urls(self) -> list[str]:
        return self.inner.server_urls()

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Close the engine and stop its loop (from any thread); calls made afterwards fail."""
        if not self._loop.is_running():
            return
        close = getattr(self.inner, "close", None)
        if close is not None:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
