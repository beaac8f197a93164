"""Writes under one budget: adding checkpoint files and removing them to make room.

* A file is written to a locked temp file and fsynced outside the lock; then, under the
  cross-process lock (waited on at most its timeout): the index is brought up to date
  (not at all when the lock file's change count is where this store's own last change
  left it: ``Scanner.catch_up``), the parent must still be on disk, room is made if the
  budget or the free-space watermark needs it (leaves only, never the new file's
  ancestors, never the ``protect``ed keys), and the file is renamed into place. A save
  that cannot fit evicts nothing and raises :class:`SaveSkipped`; so does one whose name
  is on disk already (``exists``: one text rendered from other token ids): a file is
  never renamed over. An orphan (its chain's first missing parent proven absent from the
  disk) does not hold its name: it is deleted, with its descendants, and the save lands.
* ENOSPC while writing the temp file (the volume is fuller than the budget knows) makes
  room once and writes again.
* Evictions decide under the same lock, from the index caught up by the journal (or a
  listing), each victim stat'ed before it goes (``Scanner.verify_victims``): never a
  listing of a whole namespace per save. ``kvdisk gc`` decides from a fresh listing.

Pure of vLLM and torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterable, Iterator

from vllm_kvdisk.core.changes import bulk
from vllm_kvdisk.core.encode import Encoded, summary_of
from vllm_kvdisk.core.entry import Entry, Key, entry_of
from vllm_kvdisk.core.eviction import plan_eviction
from vllm_kvdisk.core.format import FormatError, Summary
from vllm_kvdisk.core.index import Index
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage.directory import Directory
from vllm_kvdisk.storage.lock import DirLock
from vllm_kvdisk.storage.pins import PinFile
from vllm_kvdisk.storage.scan import Scanner
from vllm_kvdisk.storage.stats import StoreStats

RECHECKS = 4  # eviction plans made again after a victim was not its entry's file

SKIP_REASONS = (
    "no_space",
    "lock_timeout",
    "parent_gone",
    "namespace_removed",
    "busy",
    "exists",
    "namespace_cap",
    "write_budget",  # decided by the scheduler (core/writebudget.py)
    "admission",
)


class SaveSkipped(Exception):
    """A save was not made for a reason that is no fault (no room, lock busy, parent gone)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class _Relist(Exception):
    """Eviction plans kept failing their checks: the commit lists the directory outside
    the lock, then tries once more."""


class Budget:
    def __init__(
        self,
        directory: Directory,
        lock: DirLock,
        index: Index,
        scanner: Scanner,
        stats: StoreStats,
        *,
        mutex: threading.RLock,
        space_bytes: int,
        min_free_bytes: int = 0,
        clock: Callable[[], float],
        statvfs: Callable[[int], os.statvfs_result] = os.fstatvfs,
        on_evict: Callable[[Entry], None] | None = None,
        namespace_share_pct: int = 0,
    ):
        self.directory = directory
        self.lock = lock
        self.index = index
        self.scanner = scanner
        self.stats = stats
        self.space_bytes = space_bytes
        self.min_free_bytes = min_free_bytes
        self.clock = clock
        self._mutex = mutex
        self._statvfs = statvfs
        self._on_evict = on_evict
        # Each namespace's share of the budget, in percent (0: none): eviction takes the
        # files of namespaces over it first (``core.eviction``).
        self.namespace_share_pct = namespace_share_pct
        self.pins = PinFile(directory.fd) if directory.fd >= 0 else None

    @property
    def share_bytes(self) -> int:
        return self.space_bytes * self.namespace_share_pct // 100

    def write(self, ns: str, sha1: str, encoded: Encoded, *, protect: Iterable[Key] = ()) -> Entry:
        """Write a checkpoint atomically and index it, keeping the budget and the free-space
        watermark. Raises SaveSkipped (nothing written, nothing evicted) when it cannot fit,
        its parent is gone, or the lock is busy; OSError/FormatError when writing failed."""
        with self._mutex:
            state = self.directory.namespace(ns, create=True)
            if state is None:
                raise OSError(errno.ENOENT, f"cannot create namespace {ns}")
            dir_fd = os.dup(state.fd)  # ours until the end, whatever happens to the cache
        with self._mutex:  # an orphan's name is taken over (checked under the lock)
            orphan = (ns, sha1) in self.index and self.index.chain(ns, sha1) is None
        if not orphan and _on_disk(dir_fd, f"{sha1}.kv"):  # checked again under the lock
            os.close(dir_fd)
            self.stats.skipped_saves += 1
            raise SaveSkipped("exists", f"{sha1}.kv is on disk already")
        entry = entry_of(
            ns, sha1, summary_of(encoded), encoded.size, 0, used_ns=int(self.clock() * 1e9)
        )
        try:
            with fsdir.TempFile(dir_fd, f"{sha1}.kv") as tmp:
                try:
                    written = tmp.write(encoded.buffers)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    # The volume is fuller than our budget knows: make room, try once more.
                    tmp.rewind()
                    self._commit(entry, None, protect)
                    written = tmp.write(encoded.buffers)
                if written != encoded.size:
                    raise FormatError(f"wrote {written} bytes, layout says {encoded.size}")
                entry.inode, entry.size, entry.mtime_ns = fsdir.identity(tmp.stat())
                self._commit(entry, tmp, protect)
        except SaveSkipped:
            self.stats.skipped_saves += 1
            raise
        except OSError:
            self.stats.write_failures += 1
            raise
        finally:
            os.close(dir_fd)
        return entry

    @contextlib.contextmanager
    def incoming(self, ns: str, sha1: str) -> Iterator[fsdir.TempFile]:
        """A locked temp file in ``ns`` for the bytes of ``sha1`` that come from elsewhere
        (the object tier); removed unless :meth:`adopt` renamed it into place."""
        with self._mutex:
            state = self.directory.namespace(ns, create=True)
            if state is None:
                raise OSError(errno.ENOENT, f"cannot create namespace {ns}")
            dir_fd = os.dup(state.fd)
        try:
            with fsdir.TempFile(dir_fd, f"{sha1}.kv") as tmp:
                yield tmp
        finally:
            os.close(dir_fd)

    def adopt(self, ns: str, sha1: str, tmp: fsdir.TempFile, summary: Summary) -> Entry:
        """Rename a filled and checked temp file into place like a save: under the lock,
        its parent on disk, room made, never over a file of its name (SaveSkipped)."""
        os.fsync(tmp.fd)
        st = tmp.stat()
        entry = entry_of(ns, sha1, summary, st.st_size, 0, used_ns=int(self.clock() * 1e9))
        entry.inode, entry.size, entry.mtime_ns = fsdir.identity(st)
        try:
            self._commit(entry, tmp, ())
        except SaveSkipped:
            self.stats.skipped_saves += 1
            raise
        return entry

    def _commit(self, entry: Entry, tmp: fsdir.TempFile | None, protect: Iterable[Key]) -> None:
        """Under the lock: check the parent, make room, then rename the temp file into
        place (``tmp`` None: only make room for a file of ``entry.size``). Eviction plans
        that kept failing their checks (``_Relist``) release the lock, list the directory
        outside it, and the commit is made once more. A view that is not whole (a gap) is
        listed before the lock is taken, where it changed."""
        try:
            if self.scanner.needs_listing():  # a gap: listed before the lock, not under it
                self.scanner.list_unlocked(changed=True)
            try:
                with self.lock.hold(), self._mutex:
                    self._commit_locked(entry, tmp, protect, listed=False)
                return
            except _Relist:
                self.scanner.list_unlocked()
            with self.lock.hold(), self._mutex:
                self._commit_locked(entry, tmp, protect, listed=True)
        except fsdir.LockTimeout as exc:
            raise SaveSkipped("lock_timeout", str(exc)) from None

    def _commit_locked(
        self, entry: Entry, tmp: fsdir.TempFile | None, protect: Iterable[Key], *, listed: bool
    ) -> None:
        ns = entry.ns
        self.scanner.catch_up()  # a listing only if another process changed a name
        if tmp is not None and not fsdir.same_dir(tmp.dir_fd, ns, self.directory.fd):
            raise SaveSkipped("namespace_removed", f"namespace {ns} was removed meanwhile")
        if entry.parent is not None:
            above = self.index.get(ns, entry.parent)
            if (
                above is None
                or not above.parent_tokens < entry.parent_tokens <= above.tokens
                or not self._still_there(above)
            ):
                raise SaveSkipped("parent_gone", f"parent {entry.parent[:12]} is not on disk")
        if tmp is not None and _on_disk(tmp.dir_fd, tmp.final):
            # One rendered text can come from other token ids (a sampled tokenization and
            # the canonical one): same name, other content. Renaming over it would leave
            # its children under a parent of other ids (orphans), or close a parent cycle
            # nothing can evict. Names change only under this lock, so the file stays;
            # unless it is an orphan, which nothing can load: it goes, with its own
            # descendants, and the save takes its name (a corrupt ancestor quarantined
            # after it was indexed must not keep its prefix uncached for good).
            orphaned = self._orphaned(tmp.dir_fd, ns, entry.sha1)
            if orphaned is None or not self.scanner.verify_victims(orphaned):
                raise SaveSkipped("exists", f"{tmp.final} is on disk already")
            self._delete(orphaned)
        incoming = entry.size if tmp is None else 0  # a written temp file already takes room
        need = self._shortfall(entry.size, incoming)
        if need > 0:
            keep = set(protect) | {entry.key}
            plan = self._plan(
                need, keep, [entry], lambda: self._shortfall(entry.size, incoming), listed
            )
            freed = sum(e.size for e in plan)
            need = self._shortfall(entry.size, incoming)
            if freed < need:
                raise SaveSkipped(
                    "no_space",
                    (
                        f"{need} bytes must be freed for a file of {entry.size} but only {freed} "
                        "are evictable (budget or free-space watermark)"
                    ),
                )
            self._delete(plan)
        if tmp is None:
            return
        # Counted before the name appears: a writer killed (or a rename that failed after
        # it happened: an fsync's EIO, an NFS retry) before its journal line leaves a gap,
        # and a gap makes every reader list; a name nobody counted would stay unseen.
        counted = self.lock.count_change()
        try:
            tmp.commit()
        finally:
            if tmp.committed:
                self.index.add(entry)
                self.stats.written += 1
                self.stats.bytes_written += entry.size
            self.scanner.names_changed(add=[entry] if tmp.committed else [], counted=counted)

    def _orphaned(self, dir_fd: int, ns: str, sha1: str) -> list[Entry] | None:
        """Under the lock, the index caught up: the file ``sha1`` and its descendants if it
        is an orphan, proven on disk (its entry is the file under that name, and the first
        missing parent of its chain is not on disk either); None otherwise."""
        entry = self.index.get(ns, sha1)
        if entry is None or self.index.chain(ns, sha1) is not None:
            return None
        if not self._still_there(entry):
            return None
        link = entry
        while link.parent is not None:
            above = self.index.get(ns, link.parent)
            if above is None:  # a name the index lacks may be a file it cannot read now
                if _on_disk(dir_fd, f"{link.parent}.kv"):
                    return None
                break
            if not above.parent_tokens < link.parent_tokens <= above.tokens:
                break  # an inconsistent link: hostile files
            link = above
        return [entry, *self.index.descendants(ns, sha1)]

    def _still_there(self, entry: Entry) -> bool:
        """Whether ``entry``'s file is on disk, asked of the directory (one stat): a
        parent deleted without the lock (by hand, a crash) is not counted in the lock
        file, and a refresh may have trusted an unchanged mtime. Not the mtime: a hit
        moves it."""
        state = self.directory.namespace(entry.ns)
        if state is None:
            return False
        try:
            st = os.stat(f"{entry.sha1}.kv", dir_fd=state.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_ino, st.st_size) == (entry.inode, entry.size)

    def _shortfall(self, size: int, incoming: int) -> int:
        """Bytes to free so a file of ``size`` fits the budget and the watermark
        (``incoming``: how much of it is not on the volume yet)."""
        over_budget = self.index.total_bytes + self.scanner.bad_bytes() + size - self.space_bytes
        try:
            st = self._statvfs(self.directory.fd)
            short_free = self.min_free_bytes - (st.f_bavail * st.f_frsize - incoming)
        except OSError:
            short_free = 0
        return max(over_budget, short_free)

    def _guarded(self) -> set[Key]:
        """Files never evicted now: those of a namespace holding a file known bad whose
        chain is unknown (``Scanner.guarded``), and the pinned ones within the pin share
        (``ROOT/.pins``, read under the lock like the rest of the plan)."""
        guarded = {e.key for ns in self.scanner.guarded() for e in self.index.namespace_entries(ns)}
        if self.pins is not None:
            guarded |= self.pins.kept(self.index.get, self.clock())
        return guarded

    def _groups(self) -> dict[str, str]:
        """TP groups of the indexed namespaces: ranks of one engine lose a file together."""
        return self.directory.rank_groups(self.index.namespaces())

    # -- eviction ---------------------------------------------------------------------
    def _plan(
        self,
        need: int,
        keep: set[Key],
        adding: list[Entry],
        shortfall: Callable[[], int],
        listed: bool = True,
    ) -> list[Entry]:
        """Under the lock: the leaves to delete, each checked on disk first (a stat per
        victim, never a listing: the index is caught up by the journal or a listing). A
        victim that is not the file its entry says (another replica's hits, another file
        on its name) is read again and the plan made again; after a few rounds, the
        directory is listed and stat'ed whole: outside the lock (``_Relist``, unless
        ``listed``: that was done), since every other replica's saves wait while it is
        held. SaveSkipped when no plan checked out even after that listing."""
        keep = keep | self._guarded()
        for attempt in range(RECHECKS + 1):
            if attempt == RECHECKS:
                if not listed:
                    raise _Relist
                need = shortfall()
            with bulk():  # O(files) small objects: the collector would walk the index
                # Files known bad are on disk: their parents are no leaves.
                plan = plan_eviction(
                    self.index,
                    need,
                    self.clock(),
                    keep,
                    adding=adding + self.scanner.bad_entries(),
                    groups=self._groups(),
                    share_bytes=self.share_bytes,
                )
            if self.scanner.verify_victims(plan):
                return plan
            need = shortfall()
        # Every plan, the last made after a listing, named a file the disk contradicted
        # (other processes keep saving, hitting, replacing): none is carried out unchecked.
        raise SaveSkipped(
            "no_space", "the files chosen to make room kept changing on disk: nothing evicted"
        )

    def _delete(self, plan: list[Entry]) -> None:
        if not plan:
            return
        gone: list[Entry] = []
        try:
            for entry in plan:
                state = self.directory.namespace(entry.ns)
                if state is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{entry.sha1}.kv", dir_fd=state.fd)
                self.index.remove(entry.ns, entry.sha1)
                gone.append(entry)
                self.stats.evicted += 1
                self.stats.bytes_evicted += entry.size
                if self._on_evict is not None:
                    self._on_evict(entry)
        finally:  # what went is journaled even if a later unlink failed (EIO, EACCES)
            self.scanner.names_changed(remove=[(e.ns, e.sha1, e.inode) for e in gone])

    def evict(
        self, need_bytes: int, protect: Iterable[Key] = (), *, dry_run: bool = False
    ) -> list[Entry]:
        """Delete the lowest-scored leaves until ``need_bytes`` are freed (decided under the
        lock from a fresh listing). ``dry_run``: only say what would go."""
        self.scanner.list_unlocked()  # a fresh listing, not held under the lock
        with self.lock.hold(), self._mutex:
            self.scanner.catch_up()
            plan = plan_eviction(
                self.index,
                need_bytes,
                self.clock(),
                set(protect) | self._guarded(),
                adding=self.scanner.bad_entries(),
                groups=self._groups(),
                share_bytes=self.share_bytes,
            )
            if not dry_run:
                self._delete(plan)
        return plan

    def gc_to(self, target_bytes: int, *, dry_run: bool = False) -> list[Entry]:
        with self._mutex:
            self.scanner.refresh_all()
            need = self.index.total_bytes - target_bytes
        return self.evict(need, dry_run=dry_run)


def _on_disk(dir_fd: int, name: str) -> bool:
    """Whether ``name`` exists in ``dir_fd`` (asked of the directory, not of an index
    whose refresh may have trusted an unchanged mtime)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
