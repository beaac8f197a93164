"""The cache directory: atomic checkpoint files, index rebuild, quarantine, budget.

Layout of ``root`` (0700 directories, 0600 files)::

    root/<namespace>/namespace.json   what the namespace is (self-describing)
    root/<namespace>/<sha1>.kv        checkpoints
    root/<namespace>/.tmp-*           writes in progress (never indexed)
    root/quarantine/                  files that failed to parse or verify

Invariants:
* A ``.kv`` name appears only after its bytes are written and fsynced (temp file in the same
  directory, ``os.replace``); the index learns of it after that.
* Readers open a file once and read through the descriptor: a concurrent ``os.replace`` or
  unlink by another process never changes what an open reader sees.
* Anything that fails to parse is moved to the quarantine, counted, and reported as a miss.
* The byte budget and the free-space watermark are enforced after every write by evicting
  leaves chosen by :meth:`Index.plan_eviction`; the file just written is protected.

Pure of vLLM and torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from vllm_kvdisk.format import (HEADER_FIELD_HITS, HEADER_FIELD_LAST_USED, Encoded,
                                FormatError, Meta, read_meta, read_summary, read_text)
from vllm_kvdisk.index import Entry, Index, Key
from vllm_kvdisk.keys import Fingerprint

log = logging.getLogger(__name__)

KV_NAME = re.compile(r"^[0-9a-f]{40}\.kv$")
NS_NAME = re.compile(r"^[0-9a-f]{16}$")
QUARANTINE = "quarantine"
STALE_TMP_S = 3600


@dataclass(slots=True)
class StoreStats:
    written: int = 0
    bytes_written: int = 0
    evicted: int = 0
    bytes_evicted: int = 0
    quarantined: int = 0
    write_failures: int = 0


@dataclass(slots=True)
class _NsState:
    mtime_ns: int = -1
    names: set[str] = field(default_factory=set)


class Store:
    def __init__(self, root: str, *, space_bytes: int, min_free_bytes: int = 0,
                 clock: Callable[[], float] = time.time,
                 statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
                 on_evict: Callable[[Entry], None] | None = None, readonly: bool = False):
        self.root = os.path.abspath(root)
        self.space_bytes = space_bytes
        self.min_free_bytes = min_free_bytes
        self.clock = clock
        self._statvfs = statvfs
        self.index = Index()
        self.stats = StoreStats()
        self._ns: dict[str, _NsState] = {}
        self._on_evict = on_evict
        # Read-only stores (inspection tools) never move, delete or create anything; files
        # they cannot parse are only listed in ``rejected``.
        self.readonly = readonly
        self.rejected: list[tuple[str, str, str]] = []
        # Guards the index: I/O threads of one process write, evict and quarantine at once.
        # File bytes are written outside it; only index changes and deletions hold it.
        self._mutex = threading.RLock()
        if not readonly:
            os.makedirs(self.root, mode=0o700, exist_ok=True)

    # -- paths ------------------------------------------------------------------------
    def ns_dir(self, ns: str) -> str:
        return os.path.join(self.root, ns)

    def path(self, ns: str, sha1: str) -> str:
        return os.path.join(self.root, ns, f"{sha1}.kv")

    def ensure_namespace(self, fp: Fingerprint) -> str:
        ns = fp.dirname()
        path = self.ns_dir(ns)
        os.makedirs(path, mode=0o700, exist_ok=True)
        desc = os.path.join(path, "namespace.json")
        if not os.path.exists(desc):
            body = json.dumps({"digest": fp.digest().hex(), **fp.describe()}, indent=1,
                              sort_keys=True).encode()
            self._atomic_write(path, "namespace.json", [body])
        return ns

    # -- scanning ---------------------------------------------------------------------
    def namespaces(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if NS_NAME.match(n) and os.path.isdir(self.ns_dir(n)))

    def scan(self) -> None:
        """Rebuild the index from the file headers on disk (payloads untouched)."""
        with self._mutex:
            self.index.clear()
            self._ns.clear()
            self.rejected = []
            for ns in self.namespaces():
                self._refresh(ns, True)

    def refresh(self, ns: str, *, force: bool = False) -> bool:
        """Pick up files other processes added or removed. Cheap when nothing changed."""
        with self._mutex:
            return self._refresh(ns, force)

    def _refresh(self, ns: str, force: bool) -> bool:
        path = self.ns_dir(ns)
        try:
            mtime = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            mtime = -2
        state = self._ns.setdefault(ns, _NsState())
        if not force and mtime == state.mtime_ns:
            return False
        state.mtime_ns = mtime
        names: set[str] = set()
        now = self.clock()
        with contextlib.suppress(FileNotFoundError):
            with os.scandir(path) as it:
                for de in it:
                    if KV_NAME.match(de.name):
                        names.add(de.name)
                    elif de.name.startswith(".tmp-") and not self.readonly:
                        self._drop_stale_tmp(de, now)
        for gone in state.names - names:
            self.index.remove(ns, gone[:40])
        for new in sorted(names - state.names):
            self._index_file(ns, new[:40])
        state.names = names
        return True

    def _drop_stale_tmp(self, de: os.DirEntry, now: float) -> None:
        with contextlib.suppress(OSError):
            if now - de.stat().st_mtime > STALE_TMP_S:
                os.unlink(de.path)

    def _index_file(self, ns: str, sha1: str) -> Entry | None:
        """Index one file from its first page alone (the hot loop of a start-up scan)."""
        try:
            fd = os.open(f"{self.root}/{ns}/{sha1}.kv", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self.quarantine(ns, sha1, str(exc))
            return None
        try:
            size = os.fstat(fd).st_size
            sm = read_summary(fd, size)
            h = sm.header
            entry = Entry(ns, sha1, h.tokens, sm.parent_sha1, sm.parent_tokens, h.reason, h.hits,
                          h.created, h.last_used, size, sm.token_digest)
        except (FormatError, OSError) as exc:
            self.quarantine(ns, sha1, str(exc))
            return None
        finally:
            os.close(fd)
        self.index.add(entry)
        return entry

    # -- reading ----------------------------------------------------------------------
    @contextlib.contextmanager
    def open(self, ns: str, sha1: str) -> Iterator[tuple[int, Meta, int]]:
        """Open a checkpoint and parse its metadata; FormatError if it is not sound."""
        fd = os.open(self.path(ns, sha1), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            yield fd, read_meta(fd, size), size
        finally:
            os.close(fd)

    def read_text(self, ns: str, sha1: str) -> bytes:
        with self.open(ns, sha1) as (fd, meta, _):
            return read_text(fd, meta)

    def touch(self, ns: str, sha1: str) -> None:
        """A hit: bump the hit count and last-used time, in the index and in place on disk."""
        entry = self.index.get(ns, sha1)
        now = int(self.clock())
        try:
            fd = os.open(self.path(ns, sha1), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return
        try:
            hits = int.from_bytes(os.pread(fd, 4, HEADER_FIELD_HITS), "little")
            os.pwrite(fd, min(hits + 1, 0xFFFFFFFF).to_bytes(4, "little"), HEADER_FIELD_HITS)
            os.pwrite(fd, now.to_bytes(8, "little"), HEADER_FIELD_LAST_USED)
        except OSError as exc:
            log.warning("kvdisk: could not update hit count of %s: %s", sha1, exc)
        finally:
            os.close(fd)
        if entry is not None:
            with self._mutex:
                entry.hits += 1
                entry.last_used = now

    # -- writing ----------------------------------------------------------------------
    def _atomic_write(self, directory: str, name: str, buffers: list) -> int:
        tmp = os.path.join(directory, f".tmp-{name}-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            total = 0
            views = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
            while views:
                n = os.writev(fd, views[:1024])
                total += n
                while views and n >= views[0].nbytes:
                    n -= views[0].nbytes
                    views.pop(0)
                if n:
                    views[0] = views[0][n:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, os.path.join(directory, name))
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return total

    def write(self, ns: str, sha1: str, encoded: Encoded) -> Entry:
        """Write a checkpoint atomically, index it, then enforce budget and watermark."""
        with self._mutex:
            self._make_room(encoded.size, protect=(ns, sha1))
        directory = self.ns_dir(ns)
        try:
            written = self._atomic_write(directory, f"{sha1}.kv", encoded.buffers)
        except OSError:
            self.stats.write_failures += 1
            raise
        if written != encoded.size:
            raise FormatError(f"wrote {written} bytes, layout says {encoded.size}")
        h, p = encoded.header, encoded.payload
        entry = Entry(ns, sha1, h.tokens, p.parent_sha1, p.parent_tokens, h.reason, 0,
                      h.created, h.last_used, encoded.size, p.token_digest)
        with self._mutex:
            self.index.add(entry)
            self._ns.setdefault(ns, _NsState()).names.add(f"{sha1}.kv")
            self.stats.written += 1
            self.stats.bytes_written += encoded.size
            self._make_room(0, protect=(ns, sha1))
        return entry

    # -- budget -----------------------------------------------------------------------
    def free_bytes(self) -> int:
        st = self._statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _make_room(self, incoming: int, protect: Key) -> None:
        over_budget = self.index.total_bytes + incoming - self.space_bytes
        try:
            short_free = self.min_free_bytes - (self.free_bytes() - incoming)
        except OSError:
            short_free = 0
        need = max(over_budget, short_free)
        if need > 0:
            self.evict(need, protect=[protect])

    def evict(self, need_bytes: int, protect: list[Key] | tuple = ()) -> list[Entry]:
        """Delete the lowest-scored leaves until ``need_bytes`` are freed."""
        with self._mutex, self._lock():
            plan = self.index.plan_eviction(need_bytes, self.clock(), protect)
            for entry in plan:
                self.index.remove(entry.ns, entry.sha1)
                self._ns.get(entry.ns, _NsState()).names.discard(f"{entry.sha1}.kv")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(entry.ns, entry.sha1))
                self.stats.evicted += 1
                self.stats.bytes_evicted += entry.size
                if self._on_evict is not None:
                    self._on_evict(entry)
        return plan

    def gc_to(self, target_bytes: int) -> list[Entry]:
        return self.evict(self.index.total_bytes - target_bytes)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Serialise evictions between processes sharing the directory."""
        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- quarantine -------------------------------------------------------------------
    def quarantine(self, ns: str, sha1: str, why: str) -> None:
        """Move a bad file aside (never delete evidence), drop it from the index, count it."""
        with self._mutex:
            self._quarantine(ns, sha1, why)

    def _quarantine(self, ns: str, sha1: str, why: str) -> None:
        self.rejected.append((ns, sha1, why))
        if self.readonly:
            self.index.remove(ns, sha1)
            return
        qdir = os.path.join(self.root, QUARANTINE)
        os.makedirs(qdir, mode=0o700, exist_ok=True)
        dest = os.path.join(qdir, f"{ns}-{sha1}-{int(self.clock())}.kv")
        try:
            os.replace(self.path(ns, sha1), dest)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("kvdisk: could not quarantine %s: %s", sha1, exc)
                with contextlib.suppress(OSError):
                    os.unlink(self.path(ns, sha1))
            return
        finally:
            self.index.remove(ns, sha1)
            self._ns.get(ns, _NsState()).names.discard(f"{sha1}.kv")
        self.stats.quarantined += 1
        with contextlib.suppress(OSError):
            fd = os.open(dest + ".why", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(why + "\n")
        log.warning("kvdisk: quarantined %s/%s.kv: %s", ns, sha1, why)

    def quarantined_files(self) -> list[str]:
        qdir = os.path.join(self.root, QUARANTINE)
        if not os.path.isdir(qdir):
            return []
        return sorted(n for n in os.listdir(qdir) if n.endswith(".kv"))
