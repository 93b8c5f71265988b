"""A TCP port free on this host right now, for a server this process is about to start (SGLang, the
Prefect API, DeepSpeed's rendezvous). Another process may take it before the server binds it: callers
start the server at once and report a bind failure as such."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
