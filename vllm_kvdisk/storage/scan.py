"""Scanning: keeping an :class:`~vllm_kvdisk.core.index.Index` in step with the
:class:`~vllm_kvdisk.storage.directory.Directory` it describes.

* A scan reads only each file's first bytes (header, sections table, stored-id digests);
  payloads are never touched. A refresh is one stat of a namespace directory when nothing
  changed, else a re-listing: files another process added are indexed, files it deleted
  or replaced are forgotten or re-indexed. A file is known by its inode, and a forced
  refresh (every eviction decision) checks (inode, size, mtime): an inode alone is reused
  at once by the next file, and a hit changes a header in place. An mtime read within a timestamp
  tick of the directory's last change is not trusted (the next refresh lists again): a
  change in that tick would not move it.
* The view is *whole at* a change count of ``ROOT/.lock`` (``lock``) when every name of
  every namespace was indexed and no change was counted since: under the lock, a save
  then lists nothing (``catch_up``). Every name this store changes is counted
  (``names_changed``); anything that leaves a file out of the index makes the view not
  whole, so the next save lists again.
* Only a file proven corrupt in this build's format version is quarantined (by the
  ``quarantine`` the owner hands in). A file of another version is skipped (remembered
  by inode, so it is not re-read); one that cannot be read right now (EIO, ESTALE,
  EMFILE) keeps its directory "changed" and is tried again.
* A temp file whose writer is gone (its lock is free) is removed by the next refresh.
* Only regular files are opened, never blocking (``fsdir.open_regular``): a FIFO, socket,
  device node or directory named like a checkpoint is skipped, never quarantined. A file
  proven corrupt is quarantined while the descriptor it was read through is still open.

Pure of vLLM and torch.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from vllm_kvdisk.core.format import FormatError, UnsupportedFile
from vllm_kvdisk.core.entry import Entry, entry_of
from vllm_kvdisk.core.index import Index
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage.directory import KV_NAME, Directory
from vllm_kvdisk.storage.fileread import read_summary

if TYPE_CHECKING:
    from vllm_kvdisk.storage.lock import DirLock
    from vllm_kvdisk.storage.stats import StoreStats

log = get_logger(__name__)

RACY_NS = 50_000_000  # above any kernel's timestamp tick (jiffies: 1-10 ms)


def racy(mtime_ns: int, looked_ns: int) -> bool:
    """Whether a directory whose mtime was read at ``looked_ns`` may still change without
    that mtime moving: timestamps are coarse (a jiffy on ext4, a second on some file
    systems), so a change in the same tick as the look leaves the same mtime. Such an
    mtime is not remembered, and the next refresh lists the directory again."""
    tick = 1_000_000_000 if mtime_ns % 1_000_000_000 == 0 else RACY_NS
    return looked_ns - mtime_ns < tick


def identity(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one file from another under one name: its inode alone does not, since a
    freed inode is handed to the next file at once (ext4); a new file there has another
    size or mtime, and a header changed in place (hits) has another mtime."""
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(slots=True)
class _View:
    """What the last refresh of one namespace saw."""

    mtime_ns: int = -1  # the directory's mtime then (-1: list it at the next refresh)
    skipped: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (inode, why)


class Scanner:
    def __init__(self, directory: Directory, lock: DirLock, index: Index, stats: StoreStats,
                 *, mutex: threading.RLock, clock: Callable[[], float],
                 quarantine: Callable[..., bool | None]):
        self.directory = directory
        self.lock = lock
        self.index = index
        self.stats = stats
        self.clock = clock
        # Files this store refused, with why: another version's, not regular, corrupt.
        self.rejected: deque[tuple[str, str, str]] = deque(maxlen=4096)
        self._mutex = mutex
        # Called under the mutex with (ns, sha1, why, inode=, dev=): moves a file proven
        # corrupt aside, trying the lock once; None if it was busy (tried again later).
        self._quarantine = quarantine
        self._views: dict[str, _View] = {}
        # The lock file's change count at which this index was last whole (see
        # names_changed; -1: whole, while the count was unknown; None: not known whole).
        self._whole_at: int | None = None

    # -- scanning ---------------------------------------------------------------------
    def scan(self) -> None:
        """Rebuild the index from the file headers on disk (payloads untouched), after
        deleting what killed removers left (``clear_trash``, outside the mutex: it may
        take long)."""
        self.directory.clear_trash()
        with self._mutex:
            self.index.clear()
            self._whole_at = None
            self._views.clear()
            self.rejected.clear()
            self.refresh_all(force=True)

    def refresh(self, ns: str, *, force: bool = False) -> bool:
        """Pick up files other processes added, replaced or removed. Cheap when nothing
        changed (one stat of the directory). Never raises for I/O errors: they are logged
        and the index is left as it was."""
        with self._mutex:
            try:
                return self._refresh(ns, force)
            except OSError as exc:
                self._whole_at = None
                log.warning("kvdisk: could not refresh %s/%s: %s", self.directory.root, ns,
                            exc)
                return False

    def refresh_all(self, force: bool = False) -> None:
        """Refresh every namespace, forgetting those gone (under the mutex)."""
        names = self.directory.namespaces()
        for ns in (self.directory.opened() | set(self.index.namespaces())) - set(names):
            if self.directory.namespace(ns) is None:  # gone: forget its entries
                self.forget_namespace(ns)
        for ns in names:
            try:
                self._refresh(ns, force)
            except OSError as exc:
                self._whole_at = None
                log.warning("kvdisk: could not refresh %s/%s: %s", self.directory.root, ns,
                            exc)

    # -- the view under the lock ------------------------------------------------------
    def catch_up(self) -> None:
        """Under the lock and the mutex: make the index whole, unless the lock's change
        count is where this view was last whole (then no name changed since)."""
        count = self.lock.count()
        if count is None or count != self._whole_at:
            # Whole at this count (-1: whole, count unknown) unless the refresh finds a
            # file it cannot read.
            self._whole_at = -1 if count is None else count
            self.refresh_all()

    def names_changed(self) -> None:
        """Under the lock, after this store renamed or deleted checkpoint names and told
        its own index: count the change for the other stores; this view stays whole if
        it was."""
        counted = self.lock.count_change()
        if counted is None:
            self._whole_at = None  # unknown to every store: each lists at every save
            return
        before, after = counted
        whole = self._whole_at is not None and self._whole_at == (-1 if before is None
                                                                   else before)
        self._whole_at = after if whole else None

    def not_whole(self) -> None:
        """A file left the index without its name changing: list again at the next save."""
        self._whole_at = None

    def forget_namespace(self, ns: str) -> None:
        """The namespace is gone or another directory now: none of its entries stay."""
        self._whole_at = None  # a listing must find its files again
        self._views.pop(ns, None)
        for entry in self.index.namespace_entries(ns):
            self.index.remove(ns, entry.sha1)

    # -- one namespace ----------------------------------------------------------------
    def _refresh(self, ns: str, force: bool) -> bool:
        state = self.directory.namespace(ns)
        if state is None:
            self.forget_namespace(ns)
            return True
        view = self._views.setdefault(ns, _View())
        looked_ns = time.time_ns()
        mtime = os.fstat(state.fd).st_mtime_ns
        if not force and mtime == view.mtime_ns:
            return False
        listed: dict[str, int] = {}  # sha1 -> inode
        now = self.clock()
        with os.scandir(state.fd) as it:
            for de in it:
                if KV_NAME.match(de.name):
                    if de.is_file(follow_symlinks=False):
                        listed[de.name[:40]] = de.inode()
                elif de.name.startswith(fsdir.TMP_PREFIX) and not self.directory.readonly:
                    if fsdir.writer_gone(state.fd, de.name, now):
                        with contextlib.suppress(OSError):
                            os.unlink(de.name, dir_fd=state.fd)
        for entry in self.index.namespace_entries(ns):
            # Deleted or replaced by another process; when forced (every eviction decision
            # and verify), also replaced on this file's freed inode, or its header changed
            # in place (hits): a stat per file, 4 us each, so not at every lookup's refresh.
            if listed.get(entry.sha1) != entry.inode or (force and not same_file(
                    state.fd, entry)):
                self.index.remove(ns, entry.sha1)
        todo = [sha1 for sha1, inode in listed.items() if (ns, sha1) not in self.index
                and view.skipped.get(sha1, (None,))[0] != inode]
        complete = True
        for sha1, found in self._read_files(state.fd, todo):
            complete &= self._index_file(ns, view, sha1, found)
        for sha1 in set(view.skipped) - set(listed):
            del view.skipped[sha1]
        # A file we could not read right now keeps the directory "changed", so the next
        # refresh tries it again; so does an mtime too recent to be trusted.
        view.mtime_ns = mtime if complete and not racy(mtime, looked_ns) else -1
        if not complete:
            self._whole_at = None  # a file is missing from the index: list again
        return True

    def _read_files(self, dir_fd: int, names: list[str]) -> Iterator[tuple[str, Any]]:
        """Read the first bytes of many files, saying every 10 s how far a long scan is (a
        slow volume). One thread: the parse holds the GIL, and two threads measured slower.
        Each file's descriptor stays open while the caller handles what was found, so a
        corrupt file is quarantined by the identity it was read through."""
        started = last = time.monotonic()
        for done, name in enumerate(names, start=1):
            found, fd = _read_one(dir_fd, name)
            try:
                yield name, found
            finally:
                if fd >= 0:
                    os.close(fd)
            if done % 1024 == 0:
                now = time.monotonic()
                if now - last >= 10:
                    last = now
                    log.info("kvdisk: indexing %s: %d of %d files in %.0f s",
                             self.directory.root, done, len(names), now - started)

    def _index_file(self, ns: str, view: _View, sha1: str, found: Any) -> bool:
        """Index what ``_read_one`` found; False if the file should be tried again later."""
        if found is None:
            return True
        if isinstance(found, (UnsupportedFile, fsdir.NotRegularFile)):
            view.skipped[sha1] = (getattr(found, "inode", 0), str(found))
            self.rejected.append((ns, sha1, f"unsupported: {found}"))
            return True
        if isinstance(found, FormatError):
            # None: the lock was busy; the directory stays "changed" and it is tried again.
            return self._quarantine(ns, sha1, str(found), inode=getattr(found, "inode", None),
                                    dev=getattr(found, "dev", None)) is not None
        if isinstance(found, OSError):
            return self._unreadable(ns, sha1, found)
        summary, size, inode, mtime_ns = found
        self.index.add(entry_of(ns, sha1, summary, size, inode, mtime_ns, mtime_ns))
        return True

    def _unreadable(self, ns: str, sha1: str, exc: OSError) -> bool:
        self.stats.unreadable += 1
        log.warning("kvdisk: cannot read %s/%s.kv now (%s); will try again", ns, sha1, exc)
        return False


def same_file(dir_fd: int, entry: Entry) -> bool:
    """Whether ``entry``'s name in ``dir_fd`` still is the file it was (``identity``)."""
    try:
        st = os.stat(f"{entry.sha1}.kv", dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return identity(st) == (entry.inode, entry.size, entry.mtime_ns)


def _read_one(dir_fd: int, sha1: str) -> tuple[Any, int]:
    """((summary, size, inode, mtime ns) of one file, the exception it raised, or None
    if gone; the descriptor it was read through, or -1). The caller closes it."""
    try:
        fd = fsdir.open_regular(f"{sha1}.kv", dir_fd)
    except FileNotFoundError:
        return None, -1
    except OSError as exc:
        return exc, -1
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        return exc, -1
    try:
        return (read_summary(fd, st.st_size), st.st_size, st.st_ino, st.st_mtime_ns), fd
    except (FormatError, OSError) as exc:
        exc.inode, exc.dev = st.st_ino, st.st_dev  # type: ignore[union-attr]
        return exc, fd
    except Exception as exc:  # noqa: BLE001 - a bug of ours, not proof of corruption
        log.exception("kvdisk: cannot index %s.kv; leaving it alone", sha1)
        found = UnsupportedFile(f"could not be indexed: {exc!r}")
        found.inode = st.st_ino  # type: ignore[attr-defined]
        return found, fd
