"""The cache directory as descriptors: the root, its namespaces, what each says it is.

Layout of ``root`` (0700 directories, 0600 files)::

    root/<namespace>/namespace.json   what the namespace is (self-describing)
    root/<namespace>/<sha1>.kv        checkpoints
    root/<namespace>/.tmp-*           writes in progress (locked by their writer)
    root/.trash-<namespace>-*         a namespace renamed away, being deleted
    root/quarantine/                  files proven corrupt, with a .why note each
    root/.lock                        serialises name changes between processes (``lock``)
    root/.salt-key                    the key of every cache salt's digest (``secret``)

* A namespace is opened by descriptor when it is used, and reopened when its name is
  another directory now (renamed away, replaced): whoever keeps an index of it is told
  (``on_replaced``), so no entry outlives the directory it was found in. At most
  ``max_open`` namespace descriptors stay open (least recently used closed first; its
  identity is kept, so a directory replaced while closed is still told apart): a
  process's descriptors do not grow with the number of tenants (cache salts).
* At most ``max_namespaces`` namespaces: a save that would make one more is skipped.
  A namespace with nothing but its ``namespace.json``, unchanged for a while, is removed
  (``empty``, under ``ROOT/.lock``, where every save lands its file: a saver that lost
  its directory skips that save).
* Nothing is followed through a symlink, and nothing that is not a regular file is
  opened blocking or read (see ``fsdir``). A root writable by others is refused unless
  the caller allows a shared directory (or only reads).
* ``namespace.json`` is read bounded and must be a flat JSON object of scalars, what this
  package writes; anything else (a FIFO, deep nesting, 1e400, a huge file) is "not ours".
* A namespace is removed by renaming it away (the caller holds ``ROOT/.lock``), then
  deleting its files outside the lock; a ``.trash-*`` whose remover died goes at the next
  ``clear_trash`` of a writable store.

The descriptors are guarded by the mutex the caller hands in (the store's, which also
guards its index). Pure of vLLM and torch.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_kvdisk.core.keys import Fingerprint, rank_group
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir

log = get_logger(__name__)

NS_NAME = re.compile(r"^[0-9a-f]{16}$")
KV_NAME = re.compile(r"^[0-9a-f]{40}\.kv$")
TRASH_PREFIX = ".trash-"
CLOCK_NAME = ".clock"  # its mtime is the file system's time (``Directory.now_ns``)
NS_INFO_MAX_BYTES = 1 << 16  # ours are ~400 bytes
MAX_OPEN = 32  # namespace descriptors kept open
MAX_NAMESPACES = 4096


class TooManyNamespaces(OSError):
    pass


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
class NamespaceDir:
    fd: int  # -1 while closed (the least recently used beyond ``max_open``)
    ident: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the directory
    group: str | None = None  # its TP group (keys.rank_group), once read
    group_read: bool = False
    tenant: tuple[str, str] | None = None  # (lora, salt digest), once read
    tenant_read: bool = False


class Directory:
    def __init__(
        self,
        root: str,
        *,
        mutex: threading.RLock,
        on_replaced: Callable[[str, bool], None],
        readonly: bool = False,
        allow_shared_dir: bool = False,
        max_open: int = MAX_OPEN,
        max_namespaces: int = MAX_NAMESPACES,
    ):
        self.root = os.path.abspath(root)
        self.max_open = max(2, max_open)
        self.max_namespaces = max_namespaces
        # Read-only (inspection tools): never moves, deletes or creates anything.
        self.readonly = readonly
        self.fd = -1  # the root's descriptor
        self._clock_fd = -1  # ROOT/.clock's (``now_ns``)
        self.removing: list[threading.Thread] = []  # namespaces being deleted (rm, reset)
        self._mutex = mutex
        self._on_replaced = on_replaced
        # Every namespace seen (its identity, what namespace.json said), most recently
        # used last; ``_open`` of them hold a descriptor.
        self._ns: OrderedDict[str, NamespaceDir] = OrderedDict()
        self._open = 0
        # Reads of what other processes wrote drop cached pages first: not on a local disk.
        self.drops_cache = True
        if readonly and not os.path.isdir(self.root):
            return  # nothing there yet: an empty cache
        if not readonly:
            fsdir.make_dirs(self.root)
        fsdir.check_root(self.root, allow_shared=allow_shared_dir or readonly)
        self.fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.drops_cache = fsdir.drops_cache(self.fd)

    def now_ns(self) -> int | None:
        """The file system's time now: the mtime that ``futimens`` gives ``ROOT/.clock``
        (the file server's clock where it stamps times, as NFS does; where each client
        stamps them, as GlusterFS's ctime feature does, this host's). What a directory's
        mtime is judged racy by (``fsdir.racy``): this host's clock, ahead of the
        server's, made a change of the same tick look old. None where it cannot be had
        (a read-only store, a ``.clock`` that is not a regular file of ours): every
        directory is then listed at each refresh."""
        if self.readonly or self.fd < 0:
            return None
        with self._mutex:
            try:
                if self._clock_fd < 0:
                    self._clock_fd = fsdir.open_regular(
                        CLOCK_NAME, self.fd, flags=os.O_RDWR | os.O_CREAT, single_link=True
                    )
                os.utime(self._clock_fd)
                return os.fstat(self._clock_fd).st_mtime_ns
            except OSError:
                self._close_clock()
                return None

    def _close_clock(self) -> None:
        if self._clock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._clock_fd)
            self._clock_fd = -1

    def close(self) -> None:
        with self._mutex:
            self._close_clock()
            for state in self._ns.values():
                self._close(state)
            self._ns.clear()
            if self.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self.fd)
                self.fd = -1

    # -- paths and namespaces ---------------------------------------------------------
    def ns_dir(self, ns: str) -> str:
        return os.path.join(self.root, ns)

    def path(self, ns: str, sha1: str) -> str:
        return os.path.join(self.root, ns, f"{sha1}.kv")

    def namespace(self, ns: str, *, create: bool = False) -> NamespaceDir | None:
        """The open directory of ``ns`` (reopened if it was renamed or replaced, or closed
        to keep ``max_open``); under the mutex. Its ``fd`` is valid until the next call
        for another namespace may close it: use it, or ``os.dup`` it, before."""
        if self.fd < 0:
            return None
        state = self._ns.get(ns)
        if state is not None and state.fd >= 0 and fsdir.same_dir(state.fd, ns, self.fd):
            self._ns.move_to_end(ns)
            return state
        try:
            fd = (
                fsdir.make_dir(ns, self.fd)
                if create and not self.readonly
                else fsdir.open_dir(ns, self.fd)
            )
        except FileNotFoundError:
            self._replaced(ns, gone=True)
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                log.warning("kvdisk: %s/%s is not a real directory; ignored", self.root, ns)
                self._replaced(ns, gone=True)
                return None
            raise
        st = os.fstat(fd)
        if state is not None and (state.fd >= 0 or state.ident != (st.st_dev, st.st_ino)):
            self._replaced(ns)  # another directory has the name now
            state = None
        if state is None:
            state = self._ns[ns] = NamespaceDir(fd, (st.st_dev, st.st_ino))
        else:
            state.fd = fd  # the same directory, closed meanwhile
            self._ns.move_to_end(ns)
        self._open += 1
        self._close_beyond()
        return state

    def drop(self, ns: str) -> None:
        """Another store removed ``ns`` (its journal says so): close what is open of it, so
        a directory made later under the name is a new namespace, not a replacement."""
        state = self._ns.pop(ns, None)
        if state is not None:
            self._close(state)

    def _replaced(self, ns: str, *, gone: bool = False) -> None:
        """``ns`` is another directory now, or (``gone``) no namespace at all."""
        state = self._ns.pop(ns, None)
        if state is not None:
            self._close(state)
            self._on_replaced(ns, gone)

    def _close(self, state: NamespaceDir) -> None:
        if state.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(state.fd)
            state.fd = -1
            self._open -= 1

    def _close_beyond(self) -> None:
        """Close the least recently used descriptors beyond ``max_open``."""
        if self._open <= self.max_open:
            return
        for state in self._ns.values():  # least recently used first
            if state.fd >= 0:
                self._close(state)
                if self._open <= self.max_open:
                    return

    def opened(self) -> set[str]:
        """The namespaces seen and not gone (under the mutex)."""
        return set(self._ns)

    def namespaces(self) -> list[str]:
        """Namespace directories (real directories only; symlinks are ignored)."""
        if self.fd < 0:
            return []
        try:
            with os.scandir(self.fd) as it:
                return sorted(
                    de.name
                    for de in it
                    if NS_NAME.match(de.name) and de.is_dir(follow_symlinks=False)
                )
        except OSError as exc:
            log.warning("kvdisk: cannot list %s: %s", self.root, exc)
            return []

    def ensure(self, fp: Fingerprint) -> str:
        """The namespace of ``fp``, made with its ``namespace.json`` if it is not there."""
        ns = fp.dirname()
        with self._mutex:
            state = self.namespace(ns)
            if state is None and len(self.namespaces()) >= self.max_namespaces:
                raise TooManyNamespaces(
                    errno.EMFILE, f"{self.max_namespaces} namespaces in {self.root} already"
                )
            state = state or self.namespace(ns, create=True)
            if state is None:
                raise OSError(errno.ENOENT, f"cannot create namespace {ns} in {self.root}")
            try:
                os.stat("namespace.json", dir_fd=state.fd, follow_symlinks=False)
            except FileNotFoundError:
                # salt_keyed: the salt digest is keyed (``secret``); an unkeyed one is of an
                # earlier build, and its namespace is removed at start (``Store.start``).
                keyed = {"salt_keyed": True} if fp.salt_digest else {}
                body = json.dumps(
                    {"digest": fp.digest().hex(), **fp.describe(), **keyed},
                    indent=1,
                    sort_keys=True,
                ).encode()
                fsdir.write_atomic(state.fd, "namespace.json", [body])
        return ns

    def empty(self, ns: str, before: float) -> bool:
        """Whether ``ns`` holds nothing but its ``namespace.json`` (no checkpoint, no temp
        file of a write) and has not changed since ``before`` (Unix seconds)."""
        with self._mutex:
            state = self.namespace(ns)
            if state is None:
                return False
            try:
                if os.fstat(state.fd).st_mtime >= before:
                    return False
                with os.scandir(state.fd) as it:
                    return all(de.name == "namespace.json" for de in it)
            except OSError:
                return False

    def info(self, ns: str) -> tuple[dict[str, Any] | None, bool]:
        """(what namespace.json says, whether there is one to say it): a namespace whose
        creator has not written it yet is asked again later; one that is not ours is not."""
        with self._mutex:
            state = self.namespace(ns)
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
                fsdir.close_read(fd)
        return parse_namespace_info(raw), True

    def rank_groups(self, names: list[str]) -> dict[str, str]:
        """Namespace -> TP group, for those of ``names`` of engines with TP > 1 (what
        ``namespace.json`` says, read once per directory)."""
        out: dict[str, str] = {}
        with self._mutex:
            for ns in names:
                state = self.namespace(ns)
                if state is None:
                    continue
                if not state.group_read:
                    info, present = self.info(ns)
                    state.group, state.group_read = rank_group(info or {}), present
                if state.group is not None:
                    out[ns] = state.group
        return out

    def tenant(self, ns: str) -> tuple[str, str] | None:
        """(LoRA adapter, salt digest) of a namespace, as its ``namespace.json`` says (read
        once per directory); None when it says nothing we understand."""
        with self._mutex:
            state = self.namespace(ns)
            if state is None:
                return None
            if not state.tenant_read:
                info, present = self.info(ns)
                lora, salt = (info or {}).get("lora"), (info or {}).get("salt_digest")
                state.tenant = (
                    (lora, salt) if isinstance(lora, str) and isinstance(salt, str) else None
                )
                state.tenant_read = present
            return state.tenant

    # -- files ------------------------------------------------------------------------
    def open_file(self, ns: str, sha1: str, *, writable: bool = False) -> int:
        """A descriptor of ``<ns>/<sha1>.kv``, never through a symlink (OSError if gone)."""
        with self._mutex:
            state = self.namespace(ns)
            if state is None:
                raise FileNotFoundError(errno.ENOENT, f"no namespace {ns}")
            # Never a FIFO or a device (a blocking open would stall the engine's step);
            # never written in place through a name with other hard links.
            return fsdir.open_regular(
                f"{sha1}.kv",
                state.fd,
                flags=os.O_RDWR if writable else os.O_RDONLY,
                single_link=writable,
            )

    def temp_files(self) -> list[tuple[str, str, bool]]:
        """(namespace, name, abandoned) of every temp file."""
        out = []
        with self._mutex:
            for ns in self.namespaces():
                state = self.namespace(ns)
                if state is None:
                    continue
                with os.scandir(state.fd) as it:
                    for de in it:  # a FIFO or a directory named like one is nobody's write
                        if de.name.startswith(fsdir.TMP_PREFIX) and de.is_file(
                            follow_symlinks=False
                        ):
                            out.append((ns, de.name, fsdir.writer_gone(state.fd, de.name)))
        return out

    def remove_temp(self, ns: str, name: str) -> bool:
        """Delete a temp file, only if its writer is gone."""
        with self._mutex:
            state = self.namespace(ns)
            if state is None or not fsdir.writer_gone(state.fd, name):
                return False
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=state.fd)
                return True
        return False

    # -- removing namespaces ----------------------------------------------------------
    def rename_away(self, ns: str, stamp_ms: int) -> str | None:
        """Rename a namespace to a ``.trash-*`` name (the caller holds ``ROOT/.lock``, so
        no save lands in it meanwhile); that name, or None if there was no namespace."""
        trash = f"{TRASH_PREFIX}{ns}-{os.getpid()}-{stamp_ms}"
        try:
            os.rename(ns, trash, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except FileNotFoundError:
            return None
        return trash

    def clear_trash(self) -> int:
        """Delete namespaces renamed away whose deletion never finished (the remover was
        killed, or a directory or a live writer's temp file inside kept it from being
        empty): nothing else ever sees them, and they hold space. Returns the files
        removed. A remover still at work meanwhile only finds fewer files to delete."""
        if self.readonly or self.fd < 0:
            return 0
        try:
            with os.scandir(self.fd) as it:
                entries = [(de.name, de.is_dir(follow_symlinks=False)) for de in it]
        except OSError as exc:
            log.warning("kvdisk: cannot list %s: %s", self.root, exc)
            return 0
        for name, _ in entries:  # a journal rewrite whose writer was killed (16 MiB+)
            if name.startswith(fsdir.TMP_PREFIX) and fsdir.writer_gone(self.fd, name):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.fd)
        return sum(
            self.delete_tree(name)
            for name, is_dir in entries
            if is_dir and name.startswith(TRASH_PREFIX)
        )

    def delete_tree(self, name: str, *, wait: bool = True) -> int:
        """Delete a namespace renamed away, whatever is inside; the checkpoints removed
        (``wait`` False: counted now, deleted by a thread)."""
        try:
            fd = fsdir.open_dir(name, self.fd)
        except OSError:
            return 0
        try:
            with os.scandir(fd) as it:
                removed = sum(1 for de in it if KV_NAME.match(de.name))
        except OSError:
            removed = 0
        finally:
            os.close(fd)
        # Its own descriptor of the root: the directory may be closed (and the number
        # reused) while a thread still deletes.
        root_fd = os.dup(self.fd)
        if wait:
            _rmtree(root_fd, name)
            return removed
        thread = threading.Thread(
            target=_rmtree, args=(root_fd, name), name="kvdisk-rm", daemon=True
        )
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
