"""A gate between the engine's NRI socket and a plugin, to make the plugin slow deterministically:
the plugin dials the gate's socket, the gate dials the engine's and copies bytes both ways; while
a connection's gate is shut, what the plugin sends (its answers) is held, not lost, until the
test opens it again. From the engine's side that is a plugin whose answer comes late, by exactly
as long as the test decides: no sleep, no timer but the engine's own.

`shut(requests=True)` holds the engine's requests as well: the plugin never sees the request
(a StartContainer whose work must not be done), and the engine, having had no answer by its
timeout, drops the plugin and goes on; the test then closes that connection (`close`), and the
plugin, seeing it closed, reconnects.

Each connection has its own gate and starts open, so a plugin that reconnects after the engine
dropped it registers at once. When either side closes, both are closed (what was held is then
never delivered: the engine has already given up on it). `hold_new` holds a new connection
before the engine is dialled (the plugin's registration waits, with no timeout of the
plugin's own) until the test clears it: the engine then synchronises the plugin with exactly
the containers the test made first."""

from __future__ import annotations

import os
import socket
import threading


class Connection:
    def __init__(self, plugin: socket.socket, engine: socket.socket):
        self.plugin, self.engine = plugin, engine
        self.open = threading.Event()  # the plugin's bytes (its answers) pass
        self.open.set()
        self.requests_open = threading.Event()  # the engine's bytes (its requests) pass
        self.requests_open.set()
        self.closed = threading.Event()
        self.held = threading.Event()  # set once bytes wait at the shut gate

    def shut(self, requests: bool = False) -> None:
        self.held.clear()
        self.open.clear()
        if requests:
            self.requests_open.clear()

    def close(self) -> None:
        self.closed.set()
        self.open.set()
        self.requests_open.set()
        for s in (self.plugin, self.engine):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def pump(self, src: socket.socket, dst: socket.socket, gate: threading.Event) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not gate.is_set():
                    self.held.set()
                    gate.wait()
                if self.closed.is_set():
                    break
                dst.sendall(data)
        except OSError:
            pass
        self.close()


class NRIGate:
    """Listens at `path` (give it to the plugin as --socket) and forwards to `engine_path`."""

    def __init__(self, path: str, engine_path: str):
        self.path, self.engine_path = path, engine_path
        if os.path.lexists(path):
            os.unlink(path)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        os.chmod(path, 0o600)
        self.server.listen(4)
        self.connections: list[Connection] = []
        self.accepted = 0
        self.admit = threading.Event()
        self.admit.set()
        self.changed = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                plugin, _ = self.server.accept()
            except OSError:
                return
            with self.changed:
                self.accepted += 1
                self.changed.notify_all()
            self.admit.wait()
            engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                engine.connect(self.engine_path)
            except OSError:
                plugin.close()
                engine.close()
                continue
            c = Connection(plugin, engine)
            threading.Thread(target=c.pump, args=(plugin, engine, c.open), daemon=True).start()
            threading.Thread(target=c.pump, args=(engine, plugin, c.requests_open), daemon=True).start()
            with self.changed:
                self.connections.append(c)
                self.changed.notify_all()

    def hold_new(self) -> None:
        self.admit.clear()

    def admit_new(self) -> None:
        self.admit.set()

    def wait_accepted(self, n: int, timeout: float = 30) -> None:
        """Until the plugin has dialled the gate `n` times (it reconnects by itself)."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.accepted >= n, timeout):
                raise AssertionError(f"the plugin did not dial the gate again ({self.accepted} of {n} connections)")

    @property
    def current(self) -> Connection:
        return self.connections[-1]

    def close(self) -> None:
        self.admit.set()
        self.server.close()
        for c in self.connections:
            c.close()
        if os.path.lexists(self.path):
            os.unlink(self.path)
