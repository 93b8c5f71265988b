"""An ASGI app served by uvicorn on a thread of this process (the agents' OpenAI-compatible endpoint, the trainer's
weight server), on sockets the caller bound: a port of 0 is a free one, known before the server starts."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Callable


def serve_on_thread(app: Any, sockets: list[socket.socket], name: str, what: str, **config: Any) -> Callable[[], None]:
    """Start serving `app` (a thread named `name`); returns the function that stops it. Raises when `what` has
    not started within 10 s. (log_config None: uvicorn's own dictConfig would install handlers on the process's
    logging, bound to the stream of the moment; its records go where the process sends warnings.)"""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None, lifespan="off", access_log=False, **config))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=sockets)), name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return stop
