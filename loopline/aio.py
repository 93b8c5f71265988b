"""`run(coro)`: asyncio.run for the process's blocking code, such that Ctrl-C and SIGTERM always stop it.

With plain asyncio.run in the main thread a signal can be lost, measured: Ctrl-C becomes a cancellation of
the main task, and any `except CancelledError` on the way (a cleanup that waits and returns) turns it
into a normal return; Prefect's SIGTERM exception, raised inside a task's step, is kept by that task as
its result (asyncio re-raises only KeyboardInterrupt and SystemExit), and `gather(return_exceptions=True)`
returns it as a value. Either way the process went on training after it was told to stop.

Here the event loop runs in a thread of its own and the calling thread only waits for its result, so a
signal's exception is raised in the caller, outside every coroutine. The coroutine is then cancelled and
given `unwind_s` to run its `finally` blocks (slots handed back, subprocesses killed) before the
exception goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

UNWIND_S = 30.0


def run(coro: Coroutine[Any, Any, T], unwind_s: float = UNWIND_S) -> T:
    outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
    started = threading.Event()
    running: dict[str, Any] = {}

    async def main() -> T:
        running["loop"], running["task"] = asyncio.get_running_loop(), asyncio.current_task()
        started.set()
        return await coro

    def thread_main() -> None:
        try:
            outcome.set_result(asyncio.run(main()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, which raises it
            outcome.set_exception(exc)

    # the caller's context variables (Prefect's run context: its logger) hold inside the coroutine too
    thread = threading.Thread(target=contextvars.copy_context().run, args=(thread_main,), name="loopline-aio", daemon=True)
    thread.start()
    try:
        return outcome.result()
    except BaseException:
        if not outcome.done():  # the caller was interrupted: stop the coroutine, let it clean up, then go on
            if started.wait(unwind_s):
                running["loop"].call_soon_threadsafe(running["task"].cancel)
            thread.join(unwind_s)
        raise
