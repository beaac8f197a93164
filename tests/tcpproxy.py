"""A TCP proxy in the test process, in front of a real server: it slows what the server
sends (``rate``: bytes per second of each connection, changed at any time) or freezes a transfer
midway (``hold_*``: once one connection carried that many bytes one way, nothing more is
forwarded either way until the proxy closes). The object-store tests put it between the
tier and SeaweedFS to make a store slow, or to kill a process while its PUT or GET is in
flight, deterministically."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

CHUNK = 16 * 1024


class Proxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        self.upstream = (host, upstream_port)
        self.rate: float | None = None  # bytes/s from the server, per connection
        self.hold_up: int | None = None  # client -> server bytes of one connection
        self.hold_down: int | None = None  # server -> client bytes of one connection
        self.held = threading.Event()  # a hold was reached: nothing moves any more
        self.connections = 0
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        """Close every socket: the server sees each connection end where it stood."""
        self._closed.set()
        with self._lock:
            socks, self._socks = self._socks + [self._listener], []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks += [client, server]
                self.connections += 1
            for src, dst, hold, slow in (
                (client, server, self.hold_up, False),
                (server, client, self.hold_down, True),
            ):
                args = (src, dst, hold, slow)
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, hold: int | None, slow: bool):
        sent = 0
        try:
            while True:
                data = src.recv(CHUNK)
                if self.held.is_set():
                    self._closed.wait()
                    return
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if hold is not None and sent + len(data) >= hold:
                    dst.sendall(data[: hold - sent])
                    self.held.set()
                    self._closed.wait()
                    return
                rate = self.rate if slow else None
                if rate is not None:
                    time.sleep(len(data) / rate)
                dst.sendall(data)
                sent += len(data)
        except OSError:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_RDWR)
