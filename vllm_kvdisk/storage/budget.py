"""Writes under one budget: the half of :class:`~vllm_kvdisk.storage.store.Store` that adds and
removes checkpoint files (mixed into it; it uses the store's index, namespaces and lock).

* A file is written to a locked temp file and fsynced outside the lock; then, under the
  cross-process lock (waited on at most ``lock_timeout_s``): the view of every namespace
  is refreshed (not at all when the lock file's change count is where this store's own
  last change left it: see ``Store._renamed``), the parent must still be on disk, room
  is made if the budget or the free-space watermark needs it (leaves only, never the new
  file's ancestors, never the ``protect``ed keys), and the file is renamed into place.
  A save that cannot fit evicts nothing and raises :class:`SaveSkipped`; so does one
  whose name is on disk already (``exists``: one text rendered from other token ids):
  a file is never renamed over.
* ENOSPC while writing the temp file (the volume is fuller than the budget knows) makes
  room once and writes again.
* Evictions and ``kvdisk gc`` decide from a fresh listing under the same lock; a whole
  namespace is renamed away under the lock and deleted after it (readers only miss,
  other replicas' saves do not wait); a ``.trash-*`` left by a killed remover goes at
  the next scan of a writable store.

Pure of vLLM and torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from typing import Iterable

from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.core.eviction import plan_eviction
from vllm_kvdisk.core.format import Encoded, FormatError, summary_of
from vllm_kvdisk.core.index import Entry, Key, entry_of
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage.scan import KV_NAME, identity

log = get_logger(__name__)

TRASH_PREFIX = ".trash-"
SKIP_REASONS = ("no_space", "lock_timeout", "parent_gone", "namespace_removed", "busy",
                "exists")


class SaveSkipped(Exception):
    """A save was not made for a reason that is no fault (no room, lock busy, parent gone)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class BudgetMixin:
    def write(self, ns: str, sha1: str, encoded: Encoded, *,
              protect: Iterable[Key] = ()) -> Entry:
        """Write a checkpoint atomically and index it, keeping the budget and the free-space
        watermark. Raises SaveSkipped (nothing written, nothing evicted) when it cannot fit,
        its parent is gone, or the lock is busy; OSError/FormatError when writing failed."""
        with self._mutex:
            state = self._namespace(ns, create=True)
            if state is None:
                raise OSError(errno.ENOENT, f"cannot create namespace {ns}")
            dir_fd = os.dup(state.fd)  # ours until the end, whatever happens to the cache
        if _on_disk(dir_fd, f"{sha1}.kv"):  # checked again under the lock; spares the write
            os.close(dir_fd)
            self.stats.skipped_saves += 1
            raise SaveSkipped("exists", f"{sha1}.kv is on disk already")
        entry = entry_of(ns, sha1, summary_of(encoded), encoded.size, 0,
                         used_ns=int(self.clock() * 1e9))
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
                entry.inode, entry.size, entry.mtime_ns = identity(tmp.stat())
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

    def _commit(self, entry: Entry, tmp: fsdir.TempFile | None, protect: Iterable[Key]) -> None:
        """Under the lock: check the parent, make room, then rename the temp file into
        place (``tmp`` None: only make room for a file of ``entry.size``)."""
        try:
            with self.dir_lock(), self._mutex:
                self._commit_locked(entry, tmp, protect)
        except fsdir.LockTimeout as exc:
            raise SaveSkipped("lock_timeout", str(exc)) from None

    def _commit_locked(self, entry: Entry, tmp: fsdir.TempFile | None,
                       protect: Iterable[Key]) -> None:
        ns = entry.ns
        gen = self._generation()
        if gen is None or gen != self._gen_seen:  # else no name changed since our look
            # Whole at this count (-1: whole, count unknown) unless the refresh finds a
            # file it cannot read.
            self._gen_seen = -1 if gen is None else gen
            self._refresh_all()
        if tmp is not None and not fsdir.same_dir(tmp.dir_fd, ns, self._root_fd):
            raise SaveSkipped("namespace_removed", f"namespace {ns} was removed meanwhile")
        if entry.parent is not None:
            above = self.index.get(ns, entry.parent)
            if (above is None or not above.parent_tokens < entry.parent_tokens <= above.tokens
                    or not self._still_there(above)):
                raise SaveSkipped("parent_gone", f"parent {entry.parent[:12]} is not on disk")
        if tmp is not None and _on_disk(tmp.dir_fd, tmp.final):
            # One rendered text can come from other token ids (a sampled tokenization and
            # the canonical one): same name, other content. Renaming over it would leave
            # its children under a parent of other ids (orphans), or close a parent cycle
            # nothing can evict. Names change only under this lock, so the file stays.
            raise SaveSkipped("exists", f"{tmp.final} is on disk already")
        incoming = entry.size if tmp is None else 0  # a written temp file already takes room
        need = self._shortfall(entry.size, incoming)
        if need > 0:
            self._refresh_all(force=True)  # decide evictions from the directory as it is
            need = self._shortfall(entry.size, incoming)
        if need > 0:
            keep = set(protect) | {entry.key}
            plan = plan_eviction(self.index, need, self.clock(), keep, adding=[entry],
                                 groups=self.rank_groups())
            freed = sum(e.size for e in plan)
            if freed < need:
                raise SaveSkipped("no_space", (
                    f"{need} bytes must be freed for a file of {entry.size} but only {freed} "
                    "are evictable (budget or free-space watermark)"))
            self._delete(plan)
            self._renamed()
        if tmp is None:
            return
        tmp.commit()
        self.index.add(entry)
        self._renamed()
        self.stats.written += 1
        self.stats.bytes_written += entry.size

    def _still_there(self, entry: Entry) -> bool:
        """Whether ``entry``'s file is on disk, asked of the directory (one stat): a
        parent deleted without the lock (by hand, a crash) is not counted in the lock
        file, and a refresh may have trusted an unchanged mtime. Not the mtime: a hit
        moves it."""
        state = self._namespace(entry.ns)
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
        over_budget = self.index.total_bytes + size - self.space_bytes
        try:
            st = self._statvfs(self._root_fd)
            short_free = self.min_free_bytes - (st.f_bavail * st.f_frsize - incoming)
        except OSError:
            short_free = 0
        return max(over_budget, short_free)

    # -- eviction ---------------------------------------------------------------------
    def _delete(self, plan: list[Entry]) -> None:
        for entry in plan:
            self.index.remove(entry.ns, entry.sha1)
            state = self._namespace(entry.ns)
            if state is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{entry.sha1}.kv", dir_fd=state.fd)
            self.stats.evicted += 1
            self.stats.bytes_evicted += entry.size
            if self._on_evict is not None:
                self._on_evict(entry)

    def evict(self, need_bytes: int, protect: Iterable[Key] = (), *,
              dry_run: bool = False) -> list[Entry]:
        """Delete the lowest-scored leaves until ``need_bytes`` are freed (decided under the
        lock from a fresh listing). ``dry_run``: only say what would go."""
        with self.dir_lock(), self._mutex:
            self._refresh_all(force=True)
            plan = plan_eviction(self.index, need_bytes, self.clock(), protect,
                                 groups=self.rank_groups())
            if not dry_run and plan:
                self._delete(plan)
                self._renamed()
        return plan

    def gc_to(self, target_bytes: int, *, dry_run: bool = False) -> list[Entry]:
        with self._mutex:
            self._refresh_all()
            need = self.index.total_bytes - target_bytes
        return self.evict(need, dry_run=dry_run)

    def remove_namespace(self, ns: str, *, wait: bool = True) -> int:
        """Remove a whole namespace; returns the files removed. The directory is renamed
        away under the lock, so concurrent readers of it only miss and no save lands in
        it; its files are deleted after the lock is released (100k files take minutes,
        and every other replica's saves would wait for the lock, then skip). ``wait``
        False: by a thread of their own (``reset_cache`` runs in the engine's step); a
        process that dies first leaves a ``.trash-*`` that the next scan deletes."""
        with self.dir_lock(), self._mutex:
            trash = f"{TRASH_PREFIX}{ns}-{os.getpid()}-{int(self.clock() * 1000)}"
            try:
                os.rename(ns, trash, src_dir_fd=self._root_fd, dst_dir_fd=self._root_fd)
            except FileNotFoundError:
                return 0
            self._renamed()
            self._namespace(ns)  # forget its descriptor and entries
        return self._delete_tree(trash, wait=wait)

    def clear_trash(self) -> int:
        """Delete namespaces renamed away whose deletion never finished (the remover was
        killed, or a directory or a live writer's temp file inside kept it from being
        empty): nothing else ever sees them, and they hold space. Returns the files
        removed. A remover still at work meanwhile only finds fewer files to delete."""
        if self.readonly or self._root_fd < 0:
            return 0
        try:
            with os.scandir(self._root_fd) as it:
                names = [de.name for de in it if de.name.startswith(TRASH_PREFIX)
                         and de.is_dir(follow_symlinks=False)]
        except OSError as exc:
            log.warning("kvdisk: cannot list %s: %s", self.root, exc)
            return 0
        return sum(self._delete_tree(name) for name in names)

    def _delete_tree(self, name: str, *, wait: bool = True) -> int:
        """Delete a namespace renamed away, whatever is inside; the checkpoints removed
        (``wait`` False: counted now, deleted by a thread)."""
        try:
            fd = fsdir.open_dir(name, self._root_fd)
        except OSError:
            return 0
        try:
            with os.scandir(fd) as it:
                removed = sum(1 for de in it if KV_NAME.match(de.name))
        except OSError:
            removed = 0
        finally:
            os.close(fd)
        # Its own descriptor of the root: the store may be closed (and the number reused)
        # while a thread still deletes.
        root_fd = os.dup(self._root_fd)
        if wait:
            _rmtree(root_fd, name)
            return removed
        thread = threading.Thread(target=_rmtree, args=(root_fd, name), name="kvdisk-rm",
                                  daemon=True)
        thread.start()
        with self._mutex:
            self.removing = [t for t in self.removing if t.is_alive()] + [thread]
        return removed


def _rmtree(root_fd: int, name: str) -> None:
    """``shutil.rmtree`` with ``dir_fd`` walks by descriptors and unlinks a symlink without
    following it; unlinking never opens (FIFOs and devices go too). Closes ``root_fd``."""
    try:
        shutil.rmtree(name, ignore_errors=True, dir_fd=root_fd)
    finally:
        os.close(root_fd)


def _on_disk(dir_fd: int, name: str) -> bool:
    """Whether ``name`` exists in ``dir_fd`` (asked of the directory, not of an index
    whose refresh may have trusted an unchanged mtime)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
