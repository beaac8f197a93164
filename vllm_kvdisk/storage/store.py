"""The cache directory: atomic checkpoint files, index rebuild, quarantine, one budget.

Layout of ``root`` (0700 directories, 0600 files)::

    root/<namespace>/namespace.json   what the namespace is (self-describing)
    root/<namespace>/<sha1>.kv        checkpoints
    root/<namespace>/.tmp-*           writes in progress (locked by their writer)
    root/quarantine/                  files proven corrupt, with a .why note each
    root/.lock                        serialises budget decisions between processes

Invariants:
* A ``.kv`` name appears only after its bytes are written and fsynced, and only while its
  parent is on disk: the rename happens under the lock after the parent was seen (a
  refresh never trusts an mtime read within a timestamp tick of the change: ``scan.racy``),
  and never over a file of that name (same text, maybe other ids: the save is skipped).
* Budget and free-space decisions are made under the lock from the directory as it is
  (a re-listing, unless the lock file's change count shows no name changed since this
  store's last whole view; evictions always re-list), counting every process's files,
  so N replicas keep one budget; a new file and its ancestors are never leaves of its
  own eviction plan; a save that cannot fit (an unreachable watermark) is skipped and
  evicts nothing.
* Only a file proven corrupt in this build's format version is quarantined. A file of
  another version is left alone; one that cannot be read right now (EIO, ESTALE, EMFILE)
  is skipped and tried again at the next refresh.
* Nothing is followed through a symlink, and nothing that is not a regular file is
  opened blocking or read (see ``fsdir``); an entry remembers its file's (inode, size,
  mtime), so a file replaced by another process is re-indexed, never mistaken for corrupt,
  even on the inode its predecessor freed (seen by a forced refresh, before evictions).
* A file is quarantined only while the descriptor it was proven corrupt through is open,
  and only if its name still is that file, checked and renamed under ``ROOT/.lock`` (the
  lock every writer renames under): a sound replacement is never the one moved.
* ``namespace.json`` is read bounded and must be a flat JSON object of scalars, what this
  package writes; anything else (a FIFO, deep nesting, 1e400, a huge file) is "not ours".

Pure of vLLM and torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage.budget import BudgetMixin
from vllm_kvdisk.core.config import KVDiskConfig
from vllm_kvdisk.storage.fileread import Meta, read_meta, read_text, read_token_range
from vllm_kvdisk.core.format import HEADER_FIELD_HITS, HEADER_FIELD_LAST_USED, FormatError
from vllm_kvdisk.core.index import Entry, Index
from vllm_kvdisk.core.keys import Fingerprint, rank_group
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage.quarantine import Quarantine
from vllm_kvdisk.storage.scan import ScanMixin, identity

log = get_logger(__name__)

NS_NAME = re.compile(r"^[0-9a-f]{16}$")
LOCK_TIMEOUT_S = 10.0
IDS_CACHE_BYTES = 64 << 20
NS_INFO_MAX_BYTES = 1 << 16  # ours are ~400 bytes


def parse_namespace_info(raw: bytes) -> dict[str, object] | None:
    """What a ``namespace.json`` says, if it is what this package writes: a JSON object of
    scalars (finite numbers). Anything else is None, however it fails: the json module
    raises RecursionError on deep nesting and accepts 1e400 as inf (which ``int()`` turns
    into OverflowError), and a description no reader understands is not ours."""
    if len(raw) > NS_INFO_MAX_BYTES:
        return None
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError, OverflowError, TypeError, MemoryError):
        return None
    if not isinstance(info, dict):
        return None
    for value in info.values():
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if value is not None and not isinstance(value, (str, int, float, bool)):
            return None
    return info


@dataclass(slots=True)
class StoreStats:
    written: int = 0
    bytes_written: int = 0
    evicted: int = 0
    bytes_evicted: int = 0
    quarantined: int = 0
    write_failures: int = 0
    skipped_saves: int = 0
    unreadable: int = 0  # files skipped for an I/O error (tried again later)


@dataclass(slots=True)
class _Namespace:
    fd: int
    mtime_ns: int = -1
    skipped: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (inode, why)
    group: str | None = None  # its TP group (keys.rank_group), once read
    group_read: bool = False


class Store(ScanMixin, BudgetMixin):
    def __init__(self, root: str, *, space_bytes: int, min_free_bytes: int = 0,
                 clock: Callable[[], float] = time.time,
                 statvfs: Callable[[int], os.statvfs_result] = os.fstatvfs,
                 on_evict: Callable[[Entry], None] | None = None, readonly: bool = False,
                 allow_shared_dir: bool = False, lock_timeout_s: float = LOCK_TIMEOUT_S,
                 quarantine_max_bytes: int | None = None):
        self.root = os.path.abspath(root)
        self.space_bytes = space_bytes
        self.min_free_bytes = min_free_bytes
        self.clock = clock
        self._statvfs = statvfs
        self.index = Index()
        self.stats = StoreStats()
        self._on_evict = on_evict
        self.lock_timeout_s = lock_timeout_s
        self.quarantine_max_bytes = (quarantine_max_bytes if quarantine_max_bytes is not None
                                     else max(64 << 20, space_bytes // 16))
        # Read-only stores (inspection tools) never move, delete or create anything; files
        # they cannot parse are only listed in ``rejected``.
        self.readonly = readonly
        self.rejected: deque[tuple[str, str, str]] = deque(maxlen=4096)
        # Guards the index and the descriptors: I/O threads of one process write, evict and
        # quarantine at once. Never held while waiting for the cross-process lock.
        self._mutex = threading.RLock()
        self._held = threading.local()  # depth of ROOT/.lock held by this thread, its fd
        # The lock file's change count at which this index was last whole (see _renamed;
        # -1: whole, while the count was unknown; None: not known to be whole).
        self._gen_seen: int | None = None
        self.removing: list[threading.Thread] = []  # namespaces being deleted (rm, reset)
        self._ns: dict[str, _Namespace] = {}
        self._ids: OrderedDict[tuple[str, str, int, int], np.ndarray] = OrderedDict()
        self._ids_bytes = 0
        self._root_fd = -1
        self._quarantined = Quarantine(-1, self.quarantine_max_bytes, clock)
        if readonly and not os.path.isdir(self.root):
            return  # nothing there yet: an empty cache
        if not readonly:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        fsdir.check_root(self.root, allow_shared=allow_shared_dir or readonly)
        self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._quarantined = Quarantine(self._root_fd, self.quarantine_max_bytes, clock)

    @classmethod
    def from_config(cls, config: KVDiskConfig, **kwargs: Any) -> Store:
        """The store of an engine: both connector halves build it here, so no setting of
        the config can reach one half and not the other."""
        return cls(config.kv_disk_dir, space_bytes=config.space_bytes,
                   min_free_bytes=config.min_free_bytes,
                   allow_shared_dir=config.kv_disk_allow_shared_dir,
                   lock_timeout_s=config.kv_disk_lock_timeout_s, **kwargs)

    def close(self) -> None:
        with self._mutex:
            for state in self._ns.values():
                with contextlib.suppress(OSError):
                    os.close(state.fd)
            self._ns.clear()
            if self._root_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._root_fd)
                self._root_fd = -1

    # -- paths and namespaces ---------------------------------------------------------
    def ns_dir(self, ns: str) -> str:
        return os.path.join(self.root, ns)

    def path(self, ns: str, sha1: str) -> str:
        return os.path.join(self.root, ns, f"{sha1}.kv")

    def _namespace(self, ns: str, *, create: bool = False) -> _Namespace | None:
        """The open directory of ``ns`` (reopened if it was renamed or replaced)."""
        if self._root_fd < 0:
            return None
        state = self._ns.get(ns)
        if state is not None and fsdir.same_dir(state.fd, ns, self._root_fd):
            return state
        if state is not None:
            os.close(state.fd)
            del self._ns[ns]
            self._forget_namespace(ns)
        try:
            fd = (fsdir.make_dir(ns, self._root_fd) if create and not self.readonly
                  else fsdir.open_dir(ns, self._root_fd))
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                log.warning("kvdisk: %s/%s is not a real directory; ignored", self.root, ns)
                return None
            raise
        state = _Namespace(fd)
        self._ns[ns] = state
        return state

    def _forget_namespace(self, ns: str) -> None:
        self._gen_seen = None  # a listing must find its files again
        for entry in self.index.namespace_entries(ns):
            self.index.remove(ns, entry.sha1)

    def ensure_namespace(self, fp: Fingerprint) -> str:
        ns = fp.dirname()
        with self._mutex:
            state = self._namespace(ns, create=True)
            if state is None:
                raise OSError(errno.ENOENT, f"cannot create namespace {ns} in {self.root}")
            try:
                os.stat("namespace.json", dir_fd=state.fd, follow_symlinks=False)
            except FileNotFoundError:
                body = json.dumps({"digest": fp.digest().hex(), **fp.describe()}, indent=1,
                                  sort_keys=True).encode()
                fsdir.write_atomic(state.fd, "namespace.json", [body])
        return ns

    def namespace_info(self, ns: str) -> dict | None:
        """What ``namespace.json`` says the namespace is (None if absent, unreadable or not
        ours: see ``parse_namespace_info``)."""
        return self._namespace_info(ns)[0]

    def _namespace_info(self, ns: str) -> tuple[dict | None, bool]:
        """(what namespace.json says, whether there is one to say it): a namespace whose
        creator has not written it yet is asked again later; one that is not ours is not."""
        with self._mutex:
            state = self._namespace(ns)
            if state is None:
                return None, False
            try:
                fd = fsdir.open_regular("namespace.json", state.fd)
            except FileNotFoundError:
                return None, False
            except OSError:
                return None, True
            try:
                raw = os.pread(fd, NS_INFO_MAX_BYTES + 1, 0)
            except OSError:
                return None, False
            finally:
                os.close(fd)
        return parse_namespace_info(raw), True

    def rank_groups(self) -> dict[str, str]:
        """Indexed namespace -> TP group, for namespaces of engines with TP > 1 (what
        ``namespace.json`` says, read once per directory)."""
        out: dict[str, str] = {}
        with self._mutex:
            for ns in self.index.namespaces():
                state = self._namespace(ns)
                if state is None:
                    continue
                if not state.group_read:
                    info, present = self._namespace_info(ns)
                    state.group, state.group_read = rank_group(info or {}), present
                if state.group is not None:
                    out[ns] = state.group
        return out

    def namespaces(self) -> list[str]:
        """Namespace directories (real directories only; symlinks are ignored)."""
        if self._root_fd < 0:
            return []
        try:
            with os.scandir(self._root_fd) as it:
                return sorted(de.name for de in it
                              if NS_NAME.match(de.name) and de.is_dir(follow_symlinks=False))
        except OSError as exc:
            log.warning("kvdisk: cannot list %s: %s", self.root, exc)
            return []

    # -- reading ----------------------------------------------------------------------
    def open_file(self, ns: str, sha1: str, *, writable: bool = False) -> int:
        """A descriptor of ``<ns>/<sha1>.kv``, never through a symlink (OSError if gone)."""
        with self._mutex:
            state = self._namespace(ns)
            if state is None:
                raise FileNotFoundError(errno.ENOENT, f"no namespace {ns}")
            # Never a FIFO or a device (a blocking open would stall the engine's step);
            # never written in place through a name with other hard links.
            return fsdir.open_regular(f"{sha1}.kv", state.fd,
                                      flags=os.O_RDWR if writable else os.O_RDONLY,
                                      single_link=writable)

    @contextlib.contextmanager
    def open(self, ns: str, sha1: str) -> Iterator[tuple[int, Meta, os.stat_result]]:
        """Open a checkpoint and parse its metadata; FormatError if it is not sound,
        OSError if it cannot be opened (gone, a symlink, an I/O error)."""
        fd = self.open_file(ns, sha1)
        try:
            st = os.fstat(fd)
            yield fd, read_meta(fd, st.st_size), st
        finally:
            os.close(fd)

    def read_text(self, ns: str, sha1: str) -> bytes:
        with self.open(ns, sha1) as (fd, meta, _):
            return read_text(fd, meta)

    def read_ids(self, entry: Entry, start: int, stop: int) -> np.ndarray | None:
        """Stored token ids ``[start, stop)`` of a file (cached), None if unreadable."""
        key = (entry.ns, entry.sha1, entry.inode, entry.size)  # ids never change in place
        with self._mutex:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                return ids[start:stop]
        try:
            fd = self.open_file(entry.ns, entry.sha1)
            try:
                st = os.fstat(fd)
                if (st.st_ino, st.st_size) != (entry.inode, entry.size):
                    return None  # another file now (a freed inode is reused at once)
                ids = np.frombuffer(read_token_range(fd, entry.ids_at, 0, entry.tokens),
                                    dtype="<u4")
            finally:
                os.close(fd)
        except (OSError, FormatError):
            return None
        with self._mutex:
            self._ids[key] = ids
            self._ids_bytes += ids.nbytes
            while self._ids_bytes > IDS_CACHE_BYTES and len(self._ids) > 1:
                _, old = self._ids.popitem(last=False)
                self._ids_bytes -= old.nbytes
        return ids[start:stop]

    def touch(self, ns: str, sha1: str) -> None:
        """A hit: bump the hit count and last-used time, in the index and in place on disk."""
        entry = self.index.get(ns, sha1)
        now_s = self.clock()
        now = int(now_s)
        try:
            fd = self.open_file(ns, sha1, writable=True)
        except OSError:
            return
        try:
            # The count is read, then written: replicas hitting one file at once must not
            # interleave (both read 0, both write 1). The file's own lock, held for two
            # small writes, not ROOT/.lock, which a save holds through its evictions. A
            # file system without flock still counts the hit (maybe losing a concurrent one).
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
            st = os.fstat(fd)
            if entry is not None and (st.st_ino, st.st_size) != (entry.inode, entry.size):
                return  # replaced by another process: its statistics are its own
            hits = min(int.from_bytes(os.pread(fd, 4, HEADER_FIELD_HITS), "little") + 1,
                       0xFFFFFFFF)
            os.pwrite(fd, hits.to_bytes(4, "little"), HEADER_FIELD_HITS)
            os.pwrite(fd, now.to_bytes(8, "little"), HEADER_FIELD_LAST_USED)
            # A new mtime, whatever the timestamp tick, tells other replicas' refreshes
            # that the header changed (identity): they read the hits again before they
            # rank this file for eviction.
            mtime_ns = max(time.time_ns(), st.st_mtime_ns + 1)
            os.utime(fd, ns=(st.st_atime_ns, mtime_ns))
        except OSError as exc:
            log.warning("kvdisk: could not update hit count of %s: %s", sha1, exc)
            return
        finally:
            os.close(fd)
        if entry is not None:
            with self._mutex:
                entry.hits = hits  # other replicas' hits too, read under the file's lock
                entry.last_used = now
                entry.used_ns = int(now_s * 1e9)
                if entry.mtime_ns == st.st_mtime_ns:  # else a refresh reads it again
                    entry.mtime_ns = mtime_ns

    # -- the directory lock -----------------------------------------------------------
    @contextlib.contextmanager
    def dir_lock(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold ``ROOT/.lock`` (LockTimeout after ``timeout_s``, default the store's).
        Re-entrant within a thread: a refresh under a save's lock may quarantine, which
        takes it too (a second flock of our own would wait for ourselves)."""
        depth = getattr(self._held, "depth", 0)
        if depth:
            self._held.depth = depth + 1
            try:
                yield
            finally:
                self._held.depth = depth
            return
        with fsdir.locked(self._root_fd,
                          self.lock_timeout_s if timeout_s is None else timeout_s) as fd:
            self._held.depth, self._held.fd = 1, fd
            try:
                yield
            finally:
                self._held.depth, self._held.fd = 0, -1

    # Checkpoint names change only under ROOT/.lock (a save's rename, an eviction, gc, a
    # quarantine, verify --fix, rm), and each change adds one to the u64 LE count in the
    # first 8 bytes of the lock file. A store whose index was whole at count N and sees N
    # again under the lock knows nothing was renamed or deleted since: its own temp file
    # moved the directory's mtime, nothing else did, and it does not list it again.
    def _lock_file_ours(self) -> bool:
        """Whether the lock file may be read and written: not through a name with other
        hard links (someone else's file linked as ``.lock`` would get our bytes)."""
        try:
            return os.fstat(self._held.fd).st_nlink == 1
        except OSError:
            return False

    def _generation(self) -> int | None:
        """The lock file's count (None: unknown: never written, or not ours to trust);
        under the lock."""
        if not self._lock_file_ours():
            return None
        try:
            raw = os.pread(self._held.fd, 8, 0)
        except OSError:
            return None
        return int.from_bytes(raw, "little") if len(raw) == 8 else None

    def _renamed(self) -> None:
        """Under the lock, after this store renamed or deleted checkpoint names and told
        its own index: count the change for the other stores."""
        if not self._lock_file_ours():
            self._gen_seen = None  # unknown to every store: each lists at every save
            return
        gen = self._generation()
        # An unknown count starts again at a random value, never at one a store may have
        # seen before it was lost (truncated below).
        new = secrets.randbits(64) if gen is None else gen + 1 & (1 << 64) - 1
        try:
            os.pwrite(self._held.fd, new.to_bytes(8, "little"), 0)
        except OSError as exc:
            # A count that did not move would hide the change: make it unknown, so every
            # store lists again until a later change writes it (truncating needs no space).
            log.warning("kvdisk: cannot count a change in %s/.lock: %s", self.root, exc)
            with contextlib.suppress(OSError):
                os.ftruncate(self._held.fd, 0)
            self._gen_seen = None
            return
        whole = self._gen_seen is not None and self._gen_seen == (-1 if gen is None else gen)
        self._gen_seen = new if whole else None

    # -- quarantine -------------------------------------------------------------------
    def quarantine(self, ns: str, sha1: str, why: str, *, inode: int | None = None,
                   dev: int | None = None) -> bool:
        """Move a file proven corrupt aside (never delete evidence if it can be kept), drop
        it from the index, count it. ``inode``/``dev``: only if its name is still that file
        (``fstat`` of the descriptor the caller read, still open, so the inode cannot have
        been reused), checked and moved under the directory lock."""
        if self.readonly:
            with self._mutex:
                self._forget_corrupt(ns, sha1, why, inode)
            return False
        try:
            with self.dir_lock(), self._mutex:
                return bool(self._quarantine(ns, sha1, why, inode=inode, dev=dev, wait=True))
        except fsdir.LockTimeout as exc:
            log.warning("kvdisk: %s/%s.kv not quarantined now: %s", ns, sha1, exc)
            with self._mutex:
                self._forget_corrupt(ns, sha1, why, inode)
            return False

    def _forget_corrupt(self, ns: str, sha1: str, why: str, inode: int | None) -> None:
        self.rejected.append((ns, sha1, why))
        entry = self.index.get(ns, sha1)
        if entry is not None and (inode is None or entry.inode == inode):
            self.index.remove(ns, sha1)

    def _quarantine(self, ns: str, sha1: str, why: str, *, inode: int | None = None,
                    dev: int | None = None, wait: bool = False) -> bool | None:
        """Under the mutex; whether the file was moved. ``wait``: the caller holds or may
        wait for the directory lock; otherwise (a scan, which must not wait for it while
        holding the mutex) the lock is tried once, and a busy lock leaves the move to a
        later refresh (None)."""
        self._forget_corrupt(ns, sha1, why, inode)
        state = None if self.readonly else self._namespace(ns)
        if state is None:
            return False
        try:
            with self.dir_lock(None if wait else 0.0):
                moved = self._quarantined.move(state.fd, ns, sha1, why, inode, dev)
                if moved:
                    self._renamed()
        except fsdir.LockTimeout:
            return None
        if moved:
            self.stats.quarantined += 1
        return moved

    def quarantined_files(self) -> list[str]:
        return self._quarantined.files()

    def temp_files(self) -> list[tuple[str, str, bool]]:
        """(namespace, name, abandoned) of every temp file."""
        out = []
        with self._mutex:
            for ns in self.namespaces():
                state = self._namespace(ns)
                if state is None:
                    continue
                with os.scandir(state.fd) as it:
                    for de in it:  # a FIFO or a directory named like one is nobody's write
                        if (de.name.startswith(fsdir.TMP_PREFIX)
                                and de.is_file(follow_symlinks=False)):
                            out.append((ns, de.name, fsdir.writer_gone(state.fd, de.name)))
        return out

    def remove_temp(self, ns: str, name: str) -> bool:
        """Delete a temp file, only if its writer is gone."""
        with self._mutex:
            state = self._namespace(ns)
            if state is None or not fsdir.writer_gone(state.fd, name):
                return False
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=state.fd)
                return True
        return False

    def forget(self, ns: str, sha1: str) -> None:
        """Drop a file from the index only (stale or unreadable: the next refresh may find
        it again)."""
        with self._mutex:
            self.index.remove(ns, sha1)
            self._gen_seen = None

    def orphans(self, *, remove: bool = False) -> list[Entry]:
        """Files whose chain is broken, from the directory as it is now (a forced refresh):
        never from an older view, in which a parent another replica saved since was still
        missing. ``remove``: delete them, under the lock (no name changes meanwhile), each
        only if its name still is the file that was judged."""
        if not remove or self.readonly:
            with self._mutex:
                self._refresh_all(force=True)
                return self.index.orphans()
        with self.dir_lock(), self._mutex:
            self._refresh_all(force=True)
            found = self.index.orphans()
            for entry in found:
                self.index.remove(entry.ns, entry.sha1)
                state = self._namespace(entry.ns)
                if state is None:
                    continue
                name = f"{entry.sha1}.kv"
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(name, dir_fd=state.fd, follow_symlinks=False)
                    if identity(st) == (entry.inode, entry.size, entry.mtime_ns):
                        os.unlink(name, dir_fd=state.fd)
                        self._renamed()
            return found

    def remove_file(self, ns: str, sha1: str) -> None:
        """Delete one checkpoint, under the lock like every change of a name."""
        with self.dir_lock(), self._mutex:
            self.index.remove(ns, sha1)
            state = self._namespace(ns)
            if state is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{sha1}.kv", dir_fd=state.fd)
                    self._renamed()

