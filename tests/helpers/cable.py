"""A TCP relay in a thread between clients and a server (the S3 server of the tests) that a test can pull: with
`down`, every new connection is closed as it is made; cut() also drops the open ones (kept-alive connections
broken, then refusals: what a store's outage looks like to a client), and restore() takes them again; with
`slow`, every chunk sent to the server waits that many seconds (an upload in flight for a while). With `namespace`,
it listens inside that network namespace (a pretend node's, tests/helpers/netns.py) on every address, so that the
nodes reach the server, which stays outside, through it."""
from __future__ import annotations

import contextlib
import socket
import threading
import time


class Cable:
    def __init__(self, target_port: int, namespace: str | None = None):
        self.target, self.down, self.slow = ("127.0.0.1", target_port), False, 0.0
        if namespace is None:
            self.listener = socket.create_server(("127.0.0.1", 0))
        else:
            from tests.helpers.netns import inside

            with inside(namespace):
                self.listener = socket.create_server(("0.0.0.0", 0))
        self.port = self.listener.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Refuse new connections and drop every open one."""
        with self._lock:
            self.down, sockets, self._open = True, self._open, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        self.down = False

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            if self.down:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._open += [client, upstream]
            for a, b, delayed in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, delayed), daemon=True).start()

    def _pipe(self, source, sink, delayed: bool) -> None:
        try:
            while data := source.recv(65536):
                if delayed and self.slow:
                    time.sleep(self.slow)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
