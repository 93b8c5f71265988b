"""A TCP proxy in front of the test PostgreSQL that a test can cut: a database outage for one run only, while
the other tests' databases on the same server stay up. `cut(seconds)` drops every open connection (the
server seems to have gone) and refuses new ones until the time is over.

Each connection is relayed by ONE thread that alone closes its two sockets; `cut` only shuts them down. (An
earlier version relayed each direction in its own thread, and one direction's thread closed both sockets while
the other was blocked in `recv` on one of them: on Linux `close` does not wake a blocked `recv`, so the TCP
connection stayed established with no owner, a client waited forever for an answer, and its server backend
kept its transaction: a state no real outage produces. `shutdown` wakes a blocked call; `close` does not.)"""

from __future__ import annotations

import selectors
import socket
import threading
import time


class CuttableProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.down_until = 0.0
        self.open: set[tuple[socket.socket, socket.socket]] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, seconds: float) -> None:
        with self.lock:
            self.down_until = time.monotonic() + seconds
            for pair in self.open:
                for sock in pair:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)  # the relaying thread sees EOF and closes both
                    except OSError:
                        pass

    def connections(self) -> int:
        with self.lock:
            return len(self.open)

    def _accept(self) -> None:
        while True:
            client, _ = self.server.accept()
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        pair = (client, upstream)
        for sock in pair:  # relayed at once, as by the server itself (with Nagle's algorithm a reply waited ~40 ms for an ACK)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.lock:  # (checked under the lock `cut` takes: a connection set up while it cut is refused too)
            down = time.monotonic() < self.down_until
            if not down:
                self.open.add(pair)
        try:
            if not down:
                self._relay(client, upstream)
        finally:
            with self.lock:
                self.open.discard(pair)
            for sock in pair:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    @staticmethod
    def _relay(client: socket.socket, upstream: socket.socket) -> None:
        """Both directions until either side ends (EOF or an error, which `cut` causes)."""
        other = {client: upstream, upstream: client}
        with selectors.DefaultSelector() as selector:
            for sock in other:
                selector.register(sock, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    try:
                        data = key.fileobj.recv(65536)
                        if not data:
                            return
                        other[key.fileobj].sendall(data)
                    except OSError:
                        return
