"""A TCP proxy in front of the test PostgreSQL that a test can cut: a database outage for one run only, while
the other tests' databases on the same server stay up. `cut(seconds)` drops every open connection (the
server seems to have gone) and refuses new ones until the time is over."""

from __future__ import annotations

import socket
import threading
import time


class CuttableProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.down_until = 0.0
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, seconds: float) -> None:
        with self.lock:
            self.down_until = time.monotonic() + seconds
            for sock in self.open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.open.clear()

    def _accept(self) -> None:
        while True:
            client, _ = self.server.accept()
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:  # (checked under the lock `cut` takes: a connection set up while it cut is cut too)
                if time.monotonic() < self.down_until:
                    for sock in (client, upstream):  # refused, as by a server that is down
                        sock.close()
                    continue
                self.open.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.close()
                except OSError:
                    pass
