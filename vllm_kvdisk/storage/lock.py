"""``ROOT/.lock``: the cross-process lock every change of a checkpoint name is made under,
and the count of those changes in its first 8 bytes.

* The lock is waited on for at most a timeout (``fsdir.locked``): a stuck network file
  system costs a skipped save, never a stalled engine. A ``.lock`` that cannot be
  opened or locked (a FIFO, a directory, EACCES) is a lock that is never free
  (``LockTimeout``), never an error raised into the engine. It is re-entrant within a thread:
  a refresh under a save's lock may quarantine, which takes it too (a second ``flock`` of
  our own would wait for ourselves). A read-only store (``kvdisk verify``) holds it
  through a descriptor opened for reading: it writes nothing, not even a new ``.lock``.
* Checkpoint names change only under the lock (a save's rename, an eviction, gc, a
  quarantine, ``verify --fix``, rm), and each change adds one to the u64 LE count. A store
  whose index was whole at count N and reads N again under the lock knows nothing was
  renamed or deleted since: its own temp file moved the directory's mtime, nothing else
  did (``scan.Scanner.catch_up``).
* The count is never written through a lock file with other hard links (someone else's
  file linked as ``.lock`` would get our bytes), and is then not trusted either. A count
  that could not be written is truncated (unknown), never left where it was.
* Every hold's length (from the lock taken to its release) is kept: the longest since it
  was last reset (``longest_hold_s``), what a benchmark reports. While one replica holds
  the lock, every other replica's saves wait for it, then skip.

Pure: standard library.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir

if TYPE_CHECKING:
    from vllm_kvdisk.storage.directory import Directory

log = get_logger(__name__)

LOCK_TIMEOUT_S = 10.0
_MASK = (1 << 64) - 1


class DirLock:
    def __init__(self, directory: Directory, timeout_s: float = LOCK_TIMEOUT_S):
        self.directory = directory
        self.timeout_s = timeout_s
        self._held = threading.local()  # depth of the lock held by this thread, its fd
        self.longest_hold_s = 0.0  # the longest hold, in seconds, since this was last reset
        self.last_hold_s = 0.0

    @contextlib.contextmanager
    def hold(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold ``ROOT/.lock`` (LockTimeout after ``timeout_s``, default ``timeout_s`` of
        this lock); re-entrant within a thread."""
        depth = getattr(self._held, "depth", 0)
        if depth:
            self._held.depth = depth + 1
            try:
                yield
            finally:
                self._held.depth = depth
            return
        with contextlib.ExitStack() as stack:
            try:
                fd = stack.enter_context(
                    fsdir.locked(
                        self.directory.fd,
                        self.timeout_s if timeout_s is None else timeout_s,
                        drop_cache=self.directory.drops_cache,
                        readonly=self.directory.readonly,
                    )
                )
            except fsdir.LockTimeout:
                raise
            except OSError as exc:
                # Not a file we can lock (a FIFO, a directory, EACCES, a read-only volume):
                # what a busy lock costs, a skipped change, never an error out of a start,
                # a save or a load.
                raise fsdir.LockTimeout(
                    exc.errno or errno.EIO,
                    f"cache lock {self.directory.root}/.lock unusable: {exc}",
                ) from None
            self._held.depth, self._held.fd = 1, fd
            taken = time.monotonic()
            try:
                yield
            finally:
                self._held.depth, self._held.fd = 0, -1
                # From the flock (and the drop of the lock file's cached pages) to just
                # before the descriptor is closed: the close itself is not counted.
                self.last_hold_s = time.monotonic() - taken
                self.longest_hold_s = max(self.longest_hold_s, self.last_hold_s)

    def _ours(self) -> bool:
        """Whether the lock file may be read and written: not through a name with other
        hard links."""
        try:
            return os.fstat(self._held.fd).st_nlink == 1
        except OSError:
            return False

    def count(self) -> int | None:
        """The change count (None: unknown: never written, or not ours to trust); under
        the lock."""
        if not self._ours():
            return None
        try:
            raw = os.pread(self._held.fd, 8, 0)
        except OSError:
            return None
        return int.from_bytes(raw, "little") if len(raw) == 8 else None

    def count_change(self) -> tuple[int | None, int] | None:
        """Under the lock, after a name changed: add one to the count. Returns (the count
        before, the count now), or None when the count cannot be kept (not ours, or the
        write failed: then it is unknown to every store, which lists at every save)."""
        if not self._ours():
            return None
        before = self.count()
        # An unknown count starts again at a random value, never at one a store may have
        # seen before it was lost (truncated below).
        after = secrets.randbits(64) if before is None else before + 1 & _MASK
        try:
            os.pwrite(self._held.fd, after.to_bytes(8, "little"), 0)
        except OSError as exc:
            # A count that did not move would hide the change: make it unknown, so every
            # store lists again until a later change writes it (truncating needs no space).
            log.warning("kvdisk: cannot count a change in %s/.lock: %s", self.directory.root, exc)
            with contextlib.suppress(OSError):
                os.ftruncate(self._held.fd, 0)
            return None
        return before, after
