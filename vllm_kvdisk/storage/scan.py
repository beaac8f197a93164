"""Scanning: keeping an :class:`~vllm_kvdisk.core.index.Index` in step with the
:class:`~vllm_kvdisk.storage.directory.Directory` it describes.

* The view is *whole at* a change count of ``ROOT/.lock`` (``lock``) when it holds every
  name changed up to that count. It moves along the journal's lines (``journal``): a
  refresh and a save's ``catch_up`` read what other processes changed, never listing.
  Every name this store changes is counted and journaled (``names_changed``).
* Only when the journal cannot say (none, a gap, an unknown count) does it list: one stat
  of a namespace directory when its mtime is unchanged (an mtime read within a timestamp
  tick of the change is not trusted, the tick judged by the file system's own clock,
  ``Directory.now_ns``), else a listing; a forced refresh, a catch-up's
  listing and the background listing also stat every file, (inode, size, mtime): an
  inode alone is reused at once by the next file (and a copied cache has other inodes).
* A scan reads each file's first bytes (header, sections table, stored-id digests),
  never payloads; a start reads the journal instead and lists in the background
  (``reconcile``). An eviction stats only its victims (``verify_victims``).
* Only a file proven corrupt in this build's format version is quarantined (by the
  ``quarantine`` the owner hands in). A file of another version is skipped (remembered
  by inode, so it is not re-read); one that cannot be read right now (EIO, ESTALE,
  EMFILE, a failed load: ``forget``) is known bad (``_Bad``): the view can be whole, its
  parent is no leaf, its bytes count, and its directory stays "changed", so it is tried
  again. An entry that leaves the index without its name changing makes its namespace's
  next listing real (``relist``), even when the journal says nothing changed.
* Errors are handled per namespace: one that cannot be listed is that namespace's gap,
  never the end of a listing of the others.
* A temp file whose writer is gone (its lock is free) is removed by the next listing.
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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_kvdisk.core.changes import Change, Loaded, bulk, replay
from vllm_kvdisk.core.entry import Entry, entry_of
from vllm_kvdisk.core.format import FormatError, UnsupportedFile
from vllm_kvdisk.core.index import Index
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage.directory import KV_NAME, Directory
from vllm_kvdisk.storage.fileread import read_indexable
from vllm_kvdisk.storage.journal import Journal

if TYPE_CHECKING:
    from vllm_kvdisk.storage.lock import DirLock
    from vllm_kvdisk.storage.stats import StoreStats

log = get_logger(__name__)

COMPACT_LINES = 4096  # change lines after which the journal's snapshot is rewritten


@dataclass(slots=True)
class _Bad:
    """A file known bad: its inode (0: unknown), its bytes (in the budget), and the entry
    it had, if it was ever read (its parent is then no leaf; without one, its chain is
    unknown and nothing of its namespace is evicted: ``Scanner.guarded``)."""

    inode: int
    size: int
    entry: Entry | None


@dataclass(slots=True)
class _View:
    """What the last refresh of one namespace saw."""

    mtime_ns: int = -1  # the directory's mtime then (-1: list it at the next refresh)
    skipped: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (inode, why)
    # Known bad: files on disk that cannot be read now (EIO, ESTALE, EMFILE, a failed
    # load). Known, so the index can be whole; read again at each listing of the
    # namespace, which stays "changed" while it has any.
    bad: dict[str, _Bad] = field(default_factory=dict)
    relist: bool = False  # an entry left the index: the next catch-up lists this namespace


class Scanner:
    def __init__(
        self,
        directory: Directory,
        lock: DirLock,
        index: Index,
        stats: StoreStats,
        *,
        mutex: threading.RLock,
        clock: Callable[[], float],
        quarantine: Callable[..., bool | None],
    ):
        self.directory, self.lock, self.index = directory, lock, index
        self.stats, self.clock = stats, clock
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
        self._gaps = 0  # how often the view stopped being whole (a listing checks it)
        self._changes = 0  # how many changes this store counted (``list_unlocked`` checks)
        self._count_known = True  # the lock's change count was known at the last look
        self.journal = Journal(
            directory.fd, readonly=directory.readonly, drop_cache=directory.drops_cache
        )

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

    def start(self) -> bool:
        """Start from the journal (``journal``): its snapshot and the changes after it,
        one file read instead of every file's header. False, with nothing indexed, when
        there is no usable journal or it has a gap (the caller scans). What the journal
        missed is found by ``reconcile``, which the caller runs in the background."""
        if self.directory.fd < 0:
            return False
        self.directory.clear_trash()
        with bulk():
            return self._start()

    def _start(self) -> bool:
        loaded = self.journal.load()
        if loaded is None:
            return False
        with self._mutex:
            self.index.clear()
            self._views.clear()
            self.rejected.clear()
            self._whole_at = replay(self.index, None, loaded)
            if self._whole_at is None:
                self.index.clear()
                return False
        return True

    def write_snapshot(self, timeout_s: float) -> bool:
        """After a scan: make the index whole under the lock (waited on at most
        ``timeout_s``) and write it as the journal's snapshot, so the next start reads one
        file. False if the lock was busy or the snapshot could not be written."""
        if self.directory.readonly or self.directory.fd < 0:
            return False
        try:
            with self.lock.hold(timeout_s), self._mutex:
                self.catch_up()
                count = self.lock.count()
                if count is None:  # never counted (a new cache, an older kvdisk): start
                    counted = self.lock.count_change()  # a count the journal can name
                    if counted is None:
                        return False
                    count = counted[1]
                    self._whole_at = count if self._whole_at == -1 else None
                if self._whole_at != count:
                    return False
                return self.journal.compact(count, self.on_disk())
        except fsdir.LockTimeout:
            return False

    def refresh(self, ns: str, *, force: bool = False) -> bool:
        """Pick up files other processes added, replaced or removed: from the journal's
        new lines while this view follows it, else by listing the namespace (cheap when
        nothing changed: one stat of the directory); ``force`` lists. Never raises for
        I/O errors: they are logged and the index is left as it was."""
        with self._mutex:
            try:
                if not force and self._follow():
                    return True
                return self._refresh(ns, force)
            except OSError as exc:
                self._lost(ns)
                log.warning("kvdisk: could not refresh %s/%s: %s", self.directory.root, ns, exc)
                return False

    def refresh_all(self, force: bool = False, *, identity: bool = False) -> None:
        """Refresh every namespace, forgetting those gone (under the mutex); an error is
        its namespace's alone. ``identity``: a listed namespace's files are stat'ed too."""
        names = self.directory.namespaces()
        for ns in (self.directory.opened() | set(self.index.namespaces())) - set(names):
            try:
                if self.directory.namespace(ns) is None:  # gone: forget its entries
                    self.forget_namespace(ns, gone=True)
            except OSError as exc:
                self._lost(ns)
                log.warning("kvdisk: could not open %s/%s: %s", self.directory.root, ns, exc)
        for ns in names:
            try:
                self._refresh(ns, force, identity=identity)
            except OSError as exc:
                self._lost(ns)
                log.warning("kvdisk: could not refresh %s/%s: %s", self.directory.root, ns, exc)

    # -- the view under the lock ------------------------------------------------------
    def catch_up(self) -> None:
        """Under the lock and the mutex: make the index whole, unless the lock's change
        count is where this view was last whole (then no name changed since)."""
        count = self.lock.count()
        self._count_known = count is not None
        followed = count is not None and count != self._whole_at and self._follow()
        if followed and self._whole_at == count:
            self._relist()  # the journal said what changed: only dropped entries listed
            return
        if count is None or count != self._whole_at:
            # Whole at this count (-1: whole, count unknown) once the listing is done,
            # unless it found a file it cannot read. Not before: a quarantine during the
            # listing journals a change, and a view called whole then would write a
            # snapshot of the namespaces not listed yet.
            # Each listed namespace's files are stat'ed (inode, size, mtime): after a gap
            # a name may be another file on the inode its predecessor freed.
            self._whole_at, gaps = None, self._gaps
            self.refresh_all(identity=True)
            if self._gaps == gaps:
                self._whole_at = -1 if count is None else count
                self.journal.skip_to_end()  # every line there is in what was listed

    def needs_listing(self) -> bool:
        """Whether a ``catch_up`` under the lock would list now: the view is not whole at
        a count the journal can follow from (not when the count itself is unknown: then
        every catch-up lists, and a listing before it would be a second one)."""
        return self._whole_at is None and self._count_known

    def list_unlocked(self, timeout_s: float | None = None, *, changed: bool = False) -> None:
        """List every namespace and stat every file (what a forced refresh does) without
        holding the lock through it: seconds for 100k files on a network file system,
        during which every other replica's saves would wait for the lock, then skip.
        Under the lock, briefly, the view is brought to the lock's change count by the
        journal's lines (or, at a gap, only the count is noted); the listing then runs
        outside the lock and the mutex (``reconcile``); a ``catch_up`` under the lock
        afterwards reads only the lines written since. A view that was not whole becomes
        whole at the noted count if nothing else changed it meanwhile; otherwise that
        ``catch_up`` lists. ``changed``: only the namespaces a catch-up would list (their
        directory's mtime moved, or an entry left them), not every one. LockTimeout if the
        lock stays busy past ``timeout_s``."""
        with self.lock.hold(timeout_s), self._mutex:
            count = self.lock.count()
            if count is None and not self.directory.readonly:
                # Never counted (a new or copied cache, an older kvdisk's): start a count,
                # as a snapshot does, so the catch-up under the lock can tell that nothing
                # changed since this listing (an unknown count lists there every time).
                counted = self.lock.count_change()
                if counted is not None:
                    count = counted[1]
                    self._whole_at = count if self._whole_at == -1 else None
            self._count_known = count is not None
            if count is not None and self._whole_at is not None and count != self._whole_at:
                self._follow()
            pending = None
            if count is not None and self._whole_at != count:
                # A gap: the listing below makes the view whole at this count, unless a
                # change of this store or a lost namespace comes in between.
                self._whole_at, pending = None, count
                self.journal.skip_to_end()
            marks = (self._gaps, self._changes)
            only = self._changed() if changed else None
        self.reconcile(identity=True, only=only)
        with self._mutex:
            if (
                pending is not None
                and self._whole_at is None
                and marks
                == (
                    self._gaps,
                    self._changes,
                )
            ):
                self._whole_at = pending

    def _changed(self) -> set[str]:
        """Under the mutex: the namespaces a non-forced refresh would list now (and those
        gone, whose entries go)."""
        names = self.directory.namespaces()
        out = set(self.index.namespaces()) - set(names)
        for ns in names:
            view = self._views.get(ns)
            if view is None or view.relist:
                out.add(ns)
                continue
            try:
                state = self.directory.namespace(ns)
                if state is None or os.fstat(state.fd).st_mtime_ns != view.mtime_ns:
                    out.add(ns)
            except OSError:  # the listing finds out (an error is its namespace's alone)
                out.add(ns)
        return out

    def _relist(self) -> None:
        """Under the mutex: list the namespaces an entry left without its name changing
        (``forget``), so a file dropped from the index is found again or known bad."""
        for ns in [ns for ns, view in self._views.items() if view.relist]:
            try:
                self._refresh(ns, False, identity=True)
            except OSError as exc:
                self._lost(ns)
                log.warning("kvdisk: could not refresh %s/%s: %s", self.directory.root, ns, exc)

    def _follow(self) -> bool:
        """Under the mutex: apply the journal's new lines to an index whole at a known
        count. False (and the view not whole) at a gap or when the journal cannot be read."""
        got: list[Change] | Loaded | None
        if self._whole_at is None and self.journal.replaced():
            got = self.journal.load()  # a new snapshot: follow again from there
        elif self._whole_at is None or self._whole_at < 0:
            return False
        else:
            got = self.journal.follow()
        if got is None:
            self._whole_at = None  # a line that cannot be read: list when whole matters
            return False
        with bulk():  # after a rewrite, every entry of the new snapshot
            self._whole_at = replay(self.index, self._whole_at, got)
        for change in got.changes if isinstance(got, Loaded) else got:
            # A name another store removed or wrote again is no longer known bad here.
            for ns, sha1, _ in change.remove:
                self._views.get(ns, _View()).bad.pop(sha1, None)
            for entry in change.add:
                self._views.get(entry.ns, _View()).bad.pop(entry.sha1, None)
            for ns in change.gone:
                self._views.pop(ns, None)
                self.directory.drop(ns)
        return self._whole_at is not None

    def journaled(self) -> bool:  # refreshes read the journal's lines, not listings
        return self._whole_at is not None and self._whole_at >= 0

    def names_changed(
        self,
        *,
        add: Iterable[Entry] = (),
        remove: Iterable[tuple[str, str, int | None]] = (),
        gone: Iterable[str] = (),
        counted: tuple[int | None, int] | None | bool = True,
    ) -> None:
        """Under the lock, after this store renamed or deleted checkpoint names and told
        its own index: count the change and journal what it was, for the other stores;
        this view stays whole if it was. The journal is rewritten when its change lines
        outgrow the snapshot (or there is none yet) and this view is whole. ``counted``:
        the count moved already (``DirLock.count_change``, before a rename)."""
        self._changes += 1
        if counted is True:
            counted = self.lock.count_change()
        if not isinstance(counted, tuple):
            self._lost()  # unknown to every store: each lists at every save
            return
        before, after = counted
        whole = self._whole_at is not None and self._whole_at == (-1 if before is None else before)
        self._whole_at = after if whole else None
        appended = before is not None and self.journal.append(
            Change(before, after, list(add), list(remove), list(gone))
        )
        for ns, sha1, _ in remove:
            view = self._views.get(ns)
            if view is not None:
                view.bad.pop(sha1, None)
        if whole and (not appended or self.journal.lines > max(COMPACT_LINES, len(self.index))):
            self.journal.compact(after, self.on_disk())

    def on_disk(self) -> list[Entry]:
        """What a snapshot names: the index's entries and those of files known bad."""
        return [*self.index.entries(), *self.bad_entries()]

    def bad_entries(self) -> list[Entry]:
        """The last entries of files known bad: never evicted, and their parents never
        leaves (eviction plans take them as files being added)."""
        return [
            bad.entry
            for view in self._views.values()
            for bad in view.bad.values()
            if bad.entry is not None and bad.entry.key not in self.index
        ]

    def bad_bytes(self) -> int:
        return sum(
            bad.size
            for view in self._views.values()
            for bad in view.bad.values()
            if bad.entry is None or bad.entry.key not in self.index
        )

    def guarded(self) -> set[str]:
        """Namespaces holding a file known bad that was never read: its parent, unknown,
        could be any of their files, so none of them is evicted until it is read."""
        return {
            ns
            for ns, view in self._views.items()
            if any(bad.entry is None for bad in view.bad.values())
        }

    def forget(self, ns: str, sha1: str, inode: int | None = None) -> None:
        """A file left the index without its name changing (a load failed, a corrupt file
        could not be moved now): it is known bad until the next listing of its namespace,
        which is a real one (its directory's mtime did not move) and reads it again."""
        entry = self.index.get(ns, sha1)
        if entry is not None and (inode is None or entry.inode == inode):
            self.index.remove(ns, sha1)
            self._views.setdefault(ns, _View()).bad[sha1] = _Bad(entry.inode, entry.size, entry)
        self._lost(ns)

    def relist(self, ns: str) -> None:
        """An entry left the index while its name may still be on disk: list again."""
        self._lost(ns)

    def _lost(self, ns: str | None = None) -> None:
        """The view stopped being whole; ``ns``: that namespace's next refresh lists it."""
        self._whole_at = None
        self._gaps += 1
        if ns is not None:
            view = self._views.setdefault(ns, _View())
            view.mtime_ns, view.relist = -1, True

    def forget_namespace(self, ns: str, *, gone: bool = False) -> None:
        """The namespace is another directory now, or (``gone``) no namespace at all: none
        of its entries stay. A directory that is gone takes exactly its entries with it, so
        the view stays whole (a removal another store journaled, an empty namespace
        removed); another directory under the name must be listed to be known."""
        if not gone:
            self._lost()
        self._views.pop(ns, None)
        for entry in self.index.namespace_entries(ns):
            self.index.remove(ns, entry.sha1)

    # -- one namespace ----------------------------------------------------------------
    def _refresh(self, ns: str, force: bool, *, identity: bool = False) -> bool:
        state = self.directory.namespace(ns)
        if state is None:
            self.forget_namespace(ns, gone=True)
            return True
        view = self._views.setdefault(ns, _View())
        mtime = os.fstat(state.fd).st_mtime_ns
        if not force and mtime == view.mtime_ns:
            return False
        # The file system's time, then the mtime the listing is judged by: both from the
        # clock that stamps the directory's changes (a file server's may be behind ours).
        looked_ns = self.directory.now_ns()
        mtime = os.fstat(state.fd).st_mtime_ns
        listed = self._list(state.fd)
        view.relist = False
        for entry in self.index.namespace_entries(ns):
            # Deleted or replaced by another process; when forced (every eviction decision
            # and verify) or catching up after a gap, also replaced on this file's freed
            # inode, or its header changed in place (hits): a stat per file, 4 us each, so
            # not at every lookup's refresh.
            if listed.get(entry.sha1) != entry.inode or (
                (force or identity) and not fsdir.same_file(state.fd, f"{entry.sha1}.kv", entry)
            ):
                self._drop(view, entry, entry.sha1 in listed)
        todo = [
            sha1
            for sha1, inode in listed.items()
            if (ns, sha1) not in self.index and view.skipped.get(sha1, (None,))[0] != inode
        ]
        complete = True
        for sha1, found in self._read_files(state.fd, todo):
            complete &= self._index_file(ns, view, sha1, found)
        for sha1 in set(view.skipped) - set(listed):
            del view.skipped[sha1]
        for sha1 in set(view.bad) - set(listed):
            del view.bad[sha1]
        # A file we could not read right now keeps the directory "changed", so the next
        # refresh tries it again; so does an mtime too recent to be trusted.
        trusted = complete and not view.bad and not fsdir.racy(mtime, looked_ns)
        view.mtime_ns = mtime if trusted else -1
        if not complete:
            self._lost(ns)  # a file is missing from the index: list again
        return True

    def _list(self, dir_fd: int) -> dict[str, int]:
        """sha1 -> inode of the checkpoint files listed; temp files of dead writers go."""
        listed: dict[str, int] = {}
        now = self.clock()
        with os.scandir(dir_fd) as it:
            for de in it:
                if KV_NAME.match(de.name):
                    if de.is_file(follow_symlinks=False):
                        listed[de.name[:40]] = de.inode()
                elif (
                    de.name.startswith(fsdir.TMP_PREFIX)
                    and not self.directory.readonly
                    and fsdir.writer_gone(dir_fd, de.name, now)
                ):
                    with contextlib.suppress(OSError):
                        os.unlink(de.name, dir_fd=dir_fd)
        return listed

    def reconcile(self, *, identity: bool = True, only: set[str] | None = None) -> None:
        """After a start from the journal: list every namespace once, outside the mutex
        (seconds for 100k files on a network file system, lookups go on meanwhile), and
        index what the journal missed: files of a writer killed before its line, files
        deleted without the lock, temp files of dead writers."""
        names = self.directory.namespaces()
        for ns in sorted(set(self.index.namespaces()) - set(names)) + names:
            if only is not None and ns not in only:
                continue
            try:  # an error is its namespace's alone: the others are still listed
                self._reconcile(ns, identity)
            except OSError as exc:
                with self._mutex:
                    self._lost(ns)
                log.warning("kvdisk: could not list %s/%s: %s", self.directory.root, ns, exc)

    def _reconcile(self, ns: str, identity: bool) -> None:
        with self._mutex:
            state = self.directory.namespace(ns)
            if state is None:
                self.forget_namespace(ns, gone=True)  # named by the journal, gone from disk
                return
            dir_fd = os.dup(state.fd)
            known = {e.sha1: e for e in self.index.namespace_entries(ns)}
            gaps = self._gaps
        try:
            listed = self._list(dir_fd)
            # Identity, outside the mutex (a stat per file): a cache copied to another
            # volume, a name another file took on a freed inode, are read again.
            stale = {
                sha1
                for sha1, entry in known.items()
                if sha1 in listed
                and (
                    listed[sha1] != entry.inode
                    or (identity and not fsdir.same_file(dir_fd, f"{sha1}.kv", entry))
                )
            }
            with self._mutex:
                self._settle(ns, dir_fd, known, listed, stale)
                if self._gaps == gaps and ns in self._views:
                    # Listed after every entry that left the index had left it: the
                    # listing a catch-up owed this namespace is made (``_relist``).
                    self._views[ns].relist = False
        finally:
            os.close(dir_fd)

    def _settle(
        self,
        ns: str,
        dir_fd: int,
        known: dict[str, Entry],
        listed: dict[str, int],
        stale: set[str],
    ) -> None:
        view = self._views.setdefault(ns, _View())
        for sha1, entry in known.items():
            if (
                (sha1 in stale or sha1 not in listed)
                and self.index.get(ns, sha1) is entry
                and not fsdir.still_there(
                    dir_fd, f"{sha1}.kv", entry, ask_volume=self.directory.drops_cache
                )
            ):
                self._drop(view, entry, sha1 in listed)
        todo = [
            sha1
            for sha1, inode in listed.items()
            if (ns, sha1) not in self.index and view.skipped.get(sha1, (None,))[0] != inode
        ]
        for sha1, found in self._read_files(dir_fd, todo):
            if not self._index_file(ns, view, sha1, found):
                self._lost(ns)

    def verify_victims(self, plan: list[Entry]) -> bool:
        """Under the lock and the mutex, before an eviction: whether each victim's name
        still is the file its entry describes (a stat each, not a listing). One that is
        not is forgotten or read again (another replica's hits moved its mtime, or
        another file took its name or inode); the caller plans again."""
        same = True
        for entry in plan:
            state = self.directory.namespace(entry.ns)
            if state is not None and fsdir.same_file(state.fd, f"{entry.sha1}.kv", entry):
                continue
            same = False
            if state is None:
                self.index.remove(entry.ns, entry.sha1)
            else:
                view = self._views.setdefault(entry.ns, _View())
                self._drop(view, entry, True)
                for sha1, found in self._read_files(state.fd, [entry.sha1]):
                    if not self._index_file(entry.ns, view, sha1, found):
                        self._lost(entry.ns)  # not read now: a listing must find it again
        return same

    def _drop(self, view: _View, entry: Entry, listed: bool) -> None:
        """Take an entry out of the index, its file to be read again: known bad meanwhile
        when its name is still on disk (if it cannot be read, its parent is no leaf)."""
        self.index.remove(entry.ns, entry.sha1)
        if listed:
            view.bad[entry.sha1] = _Bad(entry.inode, entry.size, entry)

    def _read_files(self, dir_fd: int, names: list[str]) -> Iterator[tuple[str, Any]]:
        """Read the first bytes of many files, saying every 10 s how far a long scan is (a
        slow volume). One thread: the parse holds the GIL, and two threads measured slower.
        Each file's descriptor stays open while the caller handles what was found, so a
        corrupt file is quarantined by the identity it was read through."""
        started = last = time.monotonic()
        for done, name in enumerate(names, start=1):
            found, fd = read_indexable(dir_fd, name)
            try:
                yield name, found
            finally:
                if fd >= 0:
                    fsdir.close_read(fd)
            if done % 1024 == 0:
                now = time.monotonic()
                if now - last >= 10:
                    last = now
                    log.info(
                        "kvdisk: indexing %s: %d of %d files in %.0f s",
                        self.directory.root,
                        done,
                        len(names),
                        now - started,
                    )

    def _index_file(self, ns: str, view: _View, sha1: str, found: Any) -> bool:
        """Index what ``_read_one`` found; False if the file should be tried again later."""
        if found is None:
            view.bad.pop(sha1, None)  # gone
            return True
        if isinstance(found, (UnsupportedFile, fsdir.NotRegularFile)):
            view.bad.pop(sha1, None)
            view.skipped[sha1] = (getattr(found, "inode", 0), str(found))
            self.rejected.append((ns, sha1, f"unsupported: {found}"))
            return True
        if isinstance(found, FormatError):
            # None: the lock was busy; the directory stays "changed" and it is tried again.
            return (
                self._quarantine(
                    ns,
                    sha1,
                    str(found),
                    inode=getattr(found, "inode", None),
                    dev=getattr(found, "dev", None),
                )
                is not None
            )
        if isinstance(found, OSError):
            self._unreadable(ns, view, sha1, found)
            return True
        summary, size, inode, mtime_ns = found
        view.bad.pop(sha1, None)
        self.index.add(entry_of(ns, sha1, summary, size, inode, mtime_ns, mtime_ns))
        return True

    def _unreadable(self, ns: str, view: _View, sha1: str, exc: OSError) -> None:
        """Record a file that cannot be read now as known bad (its last entry kept while
        the name is still its inode, or the inode is unknown), tried again later."""
        self.stats.unreadable += 1
        log.warning("kvdisk: cannot read %s/%s.kv now (%s); will try again", ns, sha1, exc)
        inode = int(getattr(exc, "inode", 0) or 0)
        size = int(getattr(exc, "size", 0) or 0)
        known = view.bad.get(sha1)
        entry = known.entry if known is not None else None
        if entry is not None and inode and entry.inode != inode:
            entry = None  # another file on the name now
        if entry is not None:
            view.bad[sha1] = _Bad(entry.inode, size or entry.size, entry)
        else:
            view.bad[sha1] = _Bad(inode, size, None)
