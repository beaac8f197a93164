"""The store: one cache directory, its index, and what may be done to them.

A :class:`Store` owns four parts, each handed what it needs:

* ``directory`` (:mod:`.directory`): the root and namespace descriptors, what each
  namespace says it is, temp files, removing namespaces;
* ``lock`` (:mod:`.lock`): ``ROOT/.lock`` and its count of name changes;
* ``scanner`` (:mod:`.scan`): keeps ``index`` in step with the directory, through the
  journal of name changes (:mod:`.journal`) where it can;
* ``budget`` (:mod:`.budget`): writes and evictions under one budget.

It does itself what needs all of them: reads (stored ids, cached), hit counts, and the
decision to quarantine a file (the move itself: :mod:`.quarantine`). One mutex guards
the index and the descriptors: the store's, handed to each part; it is never held while
waiting for ``ROOT/.lock``.

Invariants:
* A ``.kv`` name appears only after its bytes are written and fsynced, and only while its
  parent is on disk (stat'ed under the lock), never over a file of that name (same text,
  maybe other ids: the save is skipped), unless that file is an orphan proven on disk
  (deleted first, with its descendants). A quarantined file's descendants leave with it.
* Budget and free-space decisions are made under the lock, from an index caught up with
  every process's counted changes (the journal's lines, or a listing when it cannot say),
  each eviction victim stat'ed first: N replicas keep one budget. A new file's ancestors
  are never its own eviction's victims; a save that cannot fit evicts nothing.
* Only a file proven corrupt in this build's format version is quarantined. A file of
  another version is left alone; one that cannot be read right now (EIO, ESTALE, EMFILE,
  a failed load) is known bad until a listing reads it again: never offered, never an
  eviction victim, its parent no leaf (``Scanner.forget``).
* Every removal of a ``.kv`` name, the quarantine's deletion in place included, is
  counted and journaled.
* An entry remembers its file's (inode, size, mtime): a file replaced by another process
  is re-indexed, never mistaken for corrupt, even on the inode its predecessor freed.
* A file is quarantined only while the descriptor it was proven corrupt through is open,
  and only if its name still is that file, checked and renamed under ``ROOT/.lock`` (the
  lock every writer renames under): a sound replacement is never the one moved.

Pure of vLLM and torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from vllm_kvdisk.core.config import KVDiskConfig
from vllm_kvdisk.core.encode import Encoded
from vllm_kvdisk.core.entry import Entry, Key
from vllm_kvdisk.core.format import (
    HEADER_FIELD_HITS,
    HEADER_FIELD_LAST_USED,
    FormatError,
    Summary,
)
from vllm_kvdisk.core.index import Index
from vllm_kvdisk.core.keys import Fingerprint
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir, secret
from vllm_kvdisk.storage.budget import Budget, SaveSkipped
from vllm_kvdisk.storage.directory import MAX_NAMESPACES, Directory, TooManyNamespaces
from vllm_kvdisk.storage.fileread import Meta, read_meta, read_text, read_token_range
from vllm_kvdisk.storage.lock import LOCK_TIMEOUT_S, DirLock
from vllm_kvdisk.storage.quarantine import Quarantine
from vllm_kvdisk.storage.scan import Scanner
from vllm_kvdisk.storage.startup import start_up
from vllm_kvdisk.storage.stats import StoreStats

log = get_logger(__name__)

IDS_CACHE_BYTES = 64 << 20
EMPTY_NAMESPACE_AGE_S = 600.0  # an empty namespace unchanged this long is removed


class Store:
    def __init__(
        self,
        root: str,
        *,
        space_bytes: int,
        min_free_bytes: int = 0,
        clock: Callable[[], float] = time.time,
        statvfs: Callable[[int], os.statvfs_result] = os.fstatvfs,
        on_evict: Callable[[Entry], None] | None = None,
        on_drop: Callable[[Entry, str], None] | None = None,
        readonly: bool = False,
        allow_shared_dir: bool = False,
        lock_timeout_s: float = LOCK_TIMEOUT_S,
        quarantine_max_bytes: int | None = None,
        max_namespaces: int = MAX_NAMESPACES,
        namespace_share_pct: int = 0,
    ):
        self.clock = clock
        # Called with (entry, why) for each file deleted because an ancestor was
        # quarantined (``_drop_descendants``), under the lock: report and trace only.
        self._on_drop = on_drop
        self.dropped: deque[tuple[str, str, str]] = deque(maxlen=4096)  # (ns, sha1, why)
        self.index = Index()
        self.stats = StoreStats()
        self.quarantine_max_bytes = (
            quarantine_max_bytes
            if quarantine_max_bytes is not None
            else max(64 << 20, space_bytes // 16)
        )
        # Guards the index and the descriptors: I/O threads of one process write, evict and
        # quarantine at once. Never held while waiting for the cross-process lock.
        self._mutex = threading.RLock()
        self._ids: OrderedDict[tuple[str, str, int, int], np.ndarray] = OrderedDict()
        self._ids_bytes = 0
        self.directory = Directory(
            root,
            mutex=self._mutex,
            readonly=readonly,
            allow_shared_dir=allow_shared_dir,
            on_replaced=self._namespace_replaced,
            max_namespaces=max_namespaces,
        )
        # Keys every cache salt's digest (``secret``); read-only tools name no namespace.
        self.salt_key = (
            b""
            if readonly or self.directory.fd < 0
            else secret.salt_key(self.directory.fd, create=True) or b""
        )
        self.lock = DirLock(self.directory, lock_timeout_s)
        self.scanner = Scanner(
            self.directory,
            self.lock,
            self.index,
            self.stats,
            mutex=self._mutex,
            clock=clock,
            quarantine=self._quarantine,
        )
        self.budget = Budget(
            self.directory,
            self.lock,
            self.index,
            self.scanner,
            self.stats,
            mutex=self._mutex,
            space_bytes=space_bytes,
            min_free_bytes=min_free_bytes,
            clock=clock,
            statvfs=statvfs,
            on_evict=on_evict,
            namespace_share_pct=namespace_share_pct,
        )
        self._quarantined = Quarantine(self.directory.fd, self.quarantine_max_bytes, clock)

    @classmethod
    def from_config(cls, config: KVDiskConfig, **kwargs: Any) -> Store:
        """The store of an engine: both connector halves build it here, so no setting of
        the config can reach one half and not the other."""
        return cls(
            config.kv_disk_dir,
            space_bytes=config.space_bytes,
            min_free_bytes=config.min_free_bytes,
            allow_shared_dir=config.kv_disk_allow_shared_dir,
            lock_timeout_s=config.kv_disk_lock_timeout_s,
            max_namespaces=config.kv_disk_max_namespaces,
            namespace_share_pct=config.kv_disk_namespace_share_pct,
            **kwargs,
        )

    def close(self) -> None:
        self.directory.close()

    def _namespace_replaced(self, ns: str, gone: bool) -> None:
        self.scanner.forget_namespace(ns, gone=gone)

    # -- the parts' settings and state, as callers know them ---------------------------
    @property
    def root(self) -> str:
        return self.directory.root

    @property
    def readonly(self) -> bool:
        """Inspection tools' stores never move, delete or create anything; files they
        cannot parse are only listed in ``rejected``."""
        return self.directory.readonly

    @property
    def space_bytes(self) -> int:
        return self.budget.space_bytes

    @space_bytes.setter
    def space_bytes(self, value: int) -> None:
        self.budget.space_bytes = value

    @property
    def lock_timeout_s(self) -> float:
        return self.lock.timeout_s

    @property
    def rejected(self) -> deque[tuple[str, str, str]]:
        return self.scanner.rejected

    @property
    def removing(self) -> list[threading.Thread]:
        return self.directory.removing

    # -- delegated to the parts, one line each ---------------------------------------
    def scan(self) -> None:
        self.scanner.scan()

    def start(self, *, background: bool = True) -> bool:  # journal, else scan
        if not self.readonly:
            try:
                self.drop_unkeyed_salts()
                self.remove_empty_namespaces()
            except (fsdir.LockTimeout, OSError) as exc:  # housekeeping: a later start retries
                log.warning("kvdisk: namespaces of %s not tidied now: %s", self.root, exc)
        return start_up(self.scanner, self.lock_timeout_s, background=background)

    def remove_empty_namespaces(self, min_age_s: float = EMPTY_NAMESPACE_AGE_S) -> int:
        """Remove namespaces that hold nothing but ``namespace.json`` and have not changed
        for ``min_age_s``: every cache salt ever seen leaves one behind when its files are
        evicted. Judged again and renamed away under the lock, where every save lands its
        file (a saver whose directory went skips that save, ``namespace_removed``; one that
        is writing has a temp file there, so the namespace is not empty). Returns the
        namespaces removed."""
        if self.readonly:
            return 0
        removed = 0
        for ns in self.namespaces():
            before = time.time() - min_age_s
            if not self.directory.empty(ns, before):
                continue
            with self.lock.hold(), self._mutex:
                if not self.directory.empty(ns, before):
                    continue
                trash = self.directory.rename_away(ns, int(self.clock() * 1000))
                if trash is None:
                    continue
                self.directory.namespace(ns)  # forget it
                self.scanner.names_changed(gone=[ns])
            self.directory.delete_tree(trash)
            removed += 1
        return removed

    def drop_unkeyed_salts(self) -> int:
        """Remove the salted namespaces of builds before the salt key (``namespace.json``
        without ``salt_keyed``): no lookup reaches them any more (a salt's namespace is
        named by its keyed digest now), and their unkeyed digest confirms a guessed salt
        to whoever reads the directory. Returns the namespaces removed."""
        removed = 0
        for ns in self.namespaces():
            info = self.namespace_info(ns)
            if info is None or not info.get("salt_digest") or info.get("salt_keyed") is True:
                continue
            log.warning(
                "kvdisk: removing %s/%s: a cache salt's digest without a key", self.root, ns
            )
            self.remove_namespace(ns, wait=False)
            removed += 1
        return removed

    def refresh(self, ns: str, *, force: bool = False) -> bool:
        return self.scanner.refresh(ns, force=force)

    def write(self, ns: str, sha1: str, encoded: Encoded, *, protect: Iterable[Key] = ()) -> Entry:
        return self.budget.write(ns, sha1, encoded, protect=protect)

    def incoming(self, ns: str, sha1: str) -> contextlib.AbstractContextManager[fsdir.TempFile]:
        return self.budget.incoming(ns, sha1)

    def adopt(self, ns: str, sha1: str, tmp: fsdir.TempFile, summary: Summary) -> Entry:
        return self.budget.adopt(ns, sha1, tmp, summary)

    def evict(
        self, need_bytes: int, protect: Iterable[Key] = (), *, dry_run: bool = False
    ) -> list[Entry]:
        return self.budget.evict(need_bytes, protect, dry_run=dry_run)

    def gc_to(self, target_bytes: int, *, dry_run: bool = False) -> list[Entry]:
        return self.budget.gc_to(target_bytes, dry_run=dry_run)

    def ns_dir(self, ns: str) -> str:
        return self.directory.ns_dir(ns)

    def path(self, ns: str, sha1: str) -> str:
        return self.directory.path(ns, sha1)

    def namespaces(self) -> list[str]:
        return self.directory.namespaces()

    def ensure_namespace(self, fp: Fingerprint) -> str:
        try:
            return self.directory.ensure(fp)
        except TooManyNamespaces as exc:
            raise SaveSkipped("namespace_cap", str(exc)) from None

    def namespace_info(self, ns: str) -> dict[str, Any] | None:
        """What ``namespace.json`` says the namespace is (None if absent, unreadable or not
        ours: see ``directory.parse_namespace_info``)."""
        return self.directory.info(ns)[0]

    def peers(self, lora: str, salt_digest: str) -> Callable[[str], bool]:
        """Which namespaces a lookup of this scope may compare a prompt with, to explain a
        miss: those whose ``namespace.json`` names the same LoRA adapter and salt digest
        (another model, layout or dtype of the same tenant). Another salt's files never
        are: a miss reason naming them would confirm that tenant's prompts."""
        mine = (lora, salt_digest)
        return lambda other: self.directory.tenant(other) == mine

    def rank_groups(self) -> dict[str, str]:
        """Indexed namespace -> TP group, for namespaces of engines with TP > 1."""
        with self._mutex:
            return self.directory.rank_groups(self.index.namespaces())

    def temp_files(self) -> list[tuple[str, str, bool]]:
        return self.directory.temp_files()

    def remove_temp(self, ns: str, name: str) -> bool:
        return self.directory.remove_temp(ns, name)

    def clear_trash(self) -> int:
        return self.directory.clear_trash()

    def dir_lock(self, timeout_s: float | None = None) -> contextlib.AbstractContextManager[None]:
        return self.lock.hold(timeout_s)

    def pin(self, pins: list[tuple[Key, float]], share_bytes: int) -> None:
        """Keep these checkpoints from eviction until their times (epoch seconds), within
        ``share_bytes`` of pinned files (``storage/pins``). Raises like any write."""
        if self.budget.pins is None:
            raise OSError("the cache directory is not open")
        with self.lock.hold():
            self.budget.pins.add(pins, share_bytes, self.clock())

    def pinned(self) -> set[Key]:
        """The keys eviction leaves now for their pins."""
        if self.budget.pins is None:
            return set()
        with self._mutex:
            return self.budget.pins.kept(self.index.get, self.clock())

    def quarantined_files(self) -> list[str]:
        return self._quarantined.files()

    # -- reading ----------------------------------------------------------------------
    def open_file(self, ns: str, sha1: str, *, writable: bool = False) -> int:
        """A descriptor of ``<ns>/<sha1>.kv``, never through a symlink (OSError if gone)."""
        return self.directory.open_file(ns, sha1, writable=writable)

    @contextlib.contextmanager
    def open(self, ns: str, sha1: str) -> Iterator[tuple[int, Meta, os.stat_result]]:
        """Open a checkpoint and parse its metadata; FormatError if it is not sound,
        OSError if it cannot be opened (gone, a symlink, an I/O error)."""
        fd = self.open_file(ns, sha1)
        try:
            st = os.fstat(fd)
            yield fd, read_meta(fd, st.st_size), st
        finally:
            fsdir.close_read(fd)

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
                ids = np.frombuffer(
                    read_token_range(fd, entry.ids_at, 0, entry.tokens), dtype="<u4"
                )
            finally:
                fsdir.close_read(fd)
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
            # Another client's last hit is on the volume, maybe not in our cached header
            # page (GlusterFS kept it: hits through two mounts overwrote each other).
            if self.directory.drops_cache:
                fsdir.drop_cached(fd, 0, 4096)
            st = os.fstat(fd)
            if entry is not None and (st.st_ino, st.st_size) != (entry.inode, entry.size):
                return  # replaced by another process: its statistics are its own
            hits = min(int.from_bytes(os.pread(fd, 4, HEADER_FIELD_HITS), "little") + 1, 0xFFFFFFFF)
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

    # -- quarantine -------------------------------------------------------------------
    def quarantine(
        self, ns: str, sha1: str, why: str, *, inode: int | None = None, dev: int | None = None
    ) -> bool:
        """Move a file proven corrupt aside (never delete evidence if it can be kept), drop
        it from the index, count it. ``inode``/``dev``: only if its name is still that file
        (``fstat`` of the descriptor the caller read, still open, so the inode cannot have
        been reused), checked and moved under the directory lock."""
        if self.readonly:
            with self._mutex:
                self._forget_corrupt(ns, sha1, why, inode)
            return False
        try:
            if self.scanner.needs_listing():  # listed before the lock, not under it
                self.scanner.list_unlocked(changed=True)
            with self.lock.hold(), self._mutex:
                return bool(self._quarantine(ns, sha1, why, inode=inode, dev=dev, wait=True))
        except fsdir.LockTimeout as exc:
            log.warning("kvdisk: %s/%s.kv not quarantined now: %s", ns, sha1, exc)
            with self._mutex:
                self._forget_corrupt(ns, sha1, why, inode)
            return False

    def _forget_corrupt(self, ns: str, sha1: str, why: str, inode: int | None) -> None:
        """The file stays on disk for now: known bad, listed again (``Scanner.forget``)."""
        self.scanner.rejected.append((ns, sha1, why))
        self.scanner.forget(ns, sha1, inode)

    def _quarantine(
        self,
        ns: str,
        sha1: str,
        why: str,
        *,
        inode: int | None = None,
        dev: int | None = None,
        wait: bool = False,
    ) -> bool | None:
        """Under the mutex; whether the file was moved. ``wait``: the caller holds or may
        wait for the directory lock; otherwise (a scan, which must not wait for it while
        holding the mutex) the lock is tried once, and a busy lock leaves the move to a
        later refresh (None)."""
        self.scanner.rejected.append((ns, sha1, why))
        entry = self.index.get(ns, sha1)
        removed = None
        if entry is not None and (inode is None or entry.inode == inode):
            removed = self.index.remove(ns, sha1)
        state = None if self.readonly else self.directory.namespace(ns)
        if state is None:
            return False
        try:
            with self.lock.hold(None if wait else 0.0):
                done = self._quarantined.move(state.fd, ns, sha1, why, inode, dev)
                if done is not None:  # moved or deleted in place: a removal, counted
                    self.scanner.names_changed(remove=[(ns, sha1, inode)])
                    if wait:  # (a scan's listing is under way: its index is being built)
                        self.scanner.catch_up()
                    self._drop_descendants(ns, sha1, state.fd)
        except fsdir.LockTimeout:
            if removed is not None:
                self.index.add(removed)  # still on disk: known bad until it is moved
            self.scanner.forget(ns, sha1, inode)
            return None
        if done is None:  # its name left as it is (maybe another file now): list it again
            self.scanner.relist(ns)
            return False
        self.stats.quarantined += 1
        return done == "moved"

    def _drop_descendants(self, ns: str, sha1: str, dir_fd: int) -> None:
        """Under the lock and the mutex, after ``sha1`` left the directory: every file whose
        chain passes through it leaves the index and the disk. Nothing can load them any
        more, and their names, kept, would refuse the saves of the very prefixes they held
        (``exists``): the conversation would stay uncached, even after a restart. Each is
        deleted only if its name still is the file indexed: the same inode and size (names
        change only under this lock, and the index is caught up; the mtime moves with
        another replica's hit)."""
        deleted: list[Entry] = []
        for entry in self.index.descendants(ns, sha1):
            self.index.remove(ns, entry.sha1)
            name = f"{entry.sha1}.kv"
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if (st.st_ino, st.st_size) != (entry.inode, entry.size):
                    self.scanner.relist(ns)  # not the file indexed: a listing reads it
                    continue
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("kvdisk: could not delete %s/%s: %s", ns, name, exc)
                self.scanner.relist(ns)
                continue
            deleted.append(entry)
        if not deleted:
            return
        self.scanner.names_changed(remove=[(ns, e.sha1, e.inode) for e in deleted])
        why = f"its chain's file {sha1} was quarantined"
        log.warning("kvdisk: %d file(s) of %s deleted: %s", len(deleted), ns, why)
        for entry in deleted:
            self.dropped.append((ns, entry.sha1, why))
            if self._on_drop is not None:
                self._on_drop(entry, why)

    def quarantine_incoming(self, ns: str, sha1: str, tmp: fsdir.TempFile, why: str) -> bool:
        """Move a download proven corrupt (still its temp file, no checkpoint name: nothing
        to journal) to the quarantine."""
        with self._mutex:
            moved = self._quarantined.move(tmp.dir_fd, ns, sha1, why, None, source=tmp.name)
            if moved:
                self.stats.quarantined += 1
        return moved is not None

    def forget(self, ns: str, sha1: str, inode: int | None = None) -> None:
        """Drop a file from the index only (stale or unreadable: the next refresh may find
        it again); with ``inode``, only if the index still describes that file."""
        with self._mutex:
            self.scanner.forget(ns, sha1, inode)

    def orphans(self, *, remove: bool = False, locked: bool = True) -> list[Entry]:
        """Files whose chain is broken, judged like every change of a name is made: under
        the lock, from a listing run before it was taken and the journal's lines since
        (``Scanner.list_unlocked``, then ``catch_up``). A listing alone is no snapshot: a
        replica that saved a parent and its child while it ran, or evicted a child and
        then its parent (a network client may show the child a second late), made a sound
        chain look broken. Never from an older view either, in which a parent another
        replica saved since was still missing. ``remove``: delete them, under the same
        hold (no name changes meanwhile), each only if its name still is the file that
        was judged. A read-only store takes the lock too (a descriptor opened for reading:
        it writes nothing); LockTimeout if the lock is busy or unusable. ``locked`` False:
        judged from a forced listing alone, which a concurrent writer may fool."""
        if not locked:
            with self._mutex:
                self.scanner.refresh_all(force=True)
                return self.index.orphans()
        # Listed and stat'ed outside the lock (seconds for 100k files on a network file
        # system); under it, only what changed since (the journal's lines).
        self.scanner.list_unlocked()
        with self.lock.hold(), self._mutex:
            self.scanner.catch_up()
            found = self.index.orphans()
            if not remove or self.readonly:
                return found
            for entry in found:
                self.index.remove(entry.ns, entry.sha1)
                state = self.directory.namespace(entry.ns)
                if state is None:
                    continue
                name = f"{entry.sha1}.kv"
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(name, dir_fd=state.fd, follow_symlinks=False)
                    if fsdir.identity(st) == (entry.inode, entry.size, entry.mtime_ns):
                        os.unlink(name, dir_fd=state.fd)
                        self.scanner.names_changed(remove=[(entry.ns, entry.sha1, entry.inode)])
                    else:  # another file under the name now (replaced without the lock):
                        self.scanner.relist(entry.ns)  # it stays, and is read again
            return found

    def remove_file(self, ns: str, sha1: str) -> None:
        """Delete one checkpoint, under the lock like every change of a name."""
        with self.lock.hold(), self._mutex:
            self.index.remove(ns, sha1)
            state = self.directory.namespace(ns)
            if state is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{sha1}.kv", dir_fd=state.fd)
                    self.scanner.names_changed(remove=[(ns, sha1, None)])

    def remove_namespace(
        self, ns: str, *, wait: bool = True, lock_timeout_s: float | None = None
    ) -> int:
        """Remove a whole namespace; returns the files removed. The directory is renamed
        away under the lock, so concurrent readers of it only miss and no save lands in
        it; its files are deleted after the lock is released (100k files take minutes,
        and every other replica's saves would wait for the lock, then skip). ``wait``
        False: by a thread of their own (``reset_cache`` runs in the engine's step); a
        process that dies first leaves a ``.trash-*`` that the next scan deletes.
        ``lock_timeout_s``: how long to wait for the lock (LockTimeout after it; default:
        the store's)."""
        with self.lock.hold(lock_timeout_s), self._mutex:
            trash = self.directory.rename_away(ns, int(self.clock() * 1000))
            if trash is None:
                return 0
            self.directory.namespace(ns)  # forget its descriptor and entries, before
            self.scanner.names_changed(gone=[ns])  # a snapshot may be written
        return self.directory.delete_tree(trash, wait=wait)
