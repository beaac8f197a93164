"""The decision trace (``--trace FILE``): one human-readable line per decision.

    KV cache: hit for sha1=def456 (loaded 10208 tokens from 3 files)
    KV cache: miss for sha1=abc123 (reason: prefix mismatch at byte 1234)
    KV cache: saved reason=cold sha1=... tokens=... bytes=... ms=...

Lines are appended with one ``write`` on an ``O_APPEND`` descriptor, so the scheduler and
the worker processes can share one file without interleaving inside a line.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)


class Trace:
    def __init__(self, path: str | None):
        self._fd: int | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def line(self, message: str) -> None:
        text = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} KV cache: {message}"
        log.debug("%s", text)
        if self._fd is not None:
            try:
                os.write(self._fd, (text + "\n").encode())
            except OSError as exc:
                log.warning("kvdisk: trace write failed: %s", exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
