"""aio.run: a Ctrl-C or SIGTERM that arrives while the process runs a coroutine always stops it (with plain
asyncio.run both were measured lost: the run's process trained on after `loopline cancel` and SIGTERM)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import threading
import time

import pytest

from loopline import aio


class Terminated(BaseException):
    """What Prefect's SIGTERM handler raises (TerminationSignal): a BaseException asyncio does not re-raise."""


def _busy_until(deadline: float) -> None:
    while time.monotonic() < deadline:
        sum(range(10_000))  # the main thread's own Python code, where a signal's handler runs


def _signal_soon(signum: int, after_s: float = 0.3) -> None:
    threading.Timer(after_s, os.kill, (os.getpid(), signum)).start()


def test_sigterm_raised_while_coroutines_run_reaches_the_caller_and_the_coroutine_unwinds():
    unwound = threading.Event()

    async def worker() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            _busy_until(time.monotonic() + 0.05)
            await asyncio.sleep(0)

    async def rollout() -> str:
        try:  # the scheduler's shape: episodes gathered with return_exceptions=True
            await asyncio.gather(worker(), worker(), return_exceptions=True)
            return "trained on"
        finally:
            unwound.set()

    def raise_terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        _signal_soon(signal.SIGTERM)
        started = time.monotonic()
        with pytest.raises(Terminated):
            aio.run(rollout())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert time.monotonic() - started < 5 and unwound.is_set()


def test_ctrl_c_stops_a_coroutine_that_swallows_its_cancellation():
    async def stubborn() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass  # a cleanup that waits and returns
        return "trained on"

    _signal_soon(signal.SIGINT)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        aio.run(stubborn())
    assert time.monotonic() - started < 5


def test_result_error_and_context_of_the_caller():
    flavour = contextvars.ContextVar("flavour")
    flavour.set("the caller's")

    async def read() -> str:
        await asyncio.sleep(0)
        return flavour.get()

    async def fail() -> None:
        raise ValueError("its own error")

    assert aio.run(read()) == "the caller's"
    with pytest.raises(ValueError, match="its own error"):
        aio.run(fail())
