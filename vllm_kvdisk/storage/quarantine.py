"""The quarantine: files proven corrupt, moved aside with a note, bounded in size.

``ROOT/quarantine/<namespace>-<sha1>-<unix time ns>-<16 random hex>.kv`` plus a ``.why``
note beside it: a name never used twice, so two quarantines of one file in one clock
tick keep both files and both notes. Evidence is kept when it can be: a quarantine that
is not a real directory (a symlink someone planted, a plain file) is never used, and the
bad file is deleted in place instead (a removal like any other: the caller counts and
journals it). The files quarantined longest ago go first (by the time in their names,
not their write time, which a rename keeps: an old file quarantined last is the newest
evidence) once there are more than :data:`MAX_FILES` or more than ``max_bytes``.
Pure: standard library.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable

from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir

log = get_logger(__name__)

DIRNAME = "quarantine"
MAX_FILES = 256


class Quarantine:
    def __init__(self, root_fd: int, max_bytes: int, clock: Callable[[], float]):
        self.root_fd = root_fd
        self.max_bytes = max_bytes
        self.clock = clock

    def move(
        self,
        dir_fd: int,
        ns: str,
        sha1: str,
        why: str,
        inode: int | None,
        dev: int | None = None,
        *,
        source: str | None = None,
    ) -> str | None:
        """Move ``<sha1>.kv`` out of ``dir_fd``: "moved", "deleted" (the quarantine or the
        rename failed: deleted in place), None if its name was left as it is. Only a
        regular file, and only if it is still ``inode`` on ``dev``, when given. The caller
        holds the directory lock (writers rename under it, so the name cannot change
        between this check and the rename) and the descriptor it read (so the inode
        cannot be reused); it counts and journals every removal of a checkpoint name.
        ``source``: the file is a temp file of the caller's (a download) by that name."""
        name = source or f"{sha1}.kv"
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None  # a FIFO, a device, a directory: not a file of ours, not evidence
        if (inode is not None and st.st_ino != inode) or (dev is not None and st.st_dev != dev):
            return None  # a sound replacement written meanwhile: not ours to move
        try:
            qfd = fsdir.make_dir(DIRNAME, self.root_fd)
        except OSError as exc:
            log.warning("kvdisk: quarantine unusable (%s); deleting %s/%s instead", exc, ns, name)
            return _delete(dir_fd, name)
        dest = f"{ns}-{sha1}-{int(self.clock() * 1e9)}-{secrets.token_hex(8)}.kv"
        try:
            try:
                os.rename(name, dest, src_dir_fd=dir_fd, dst_dir_fd=qfd)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    return None
                log.warning("kvdisk: could not quarantine %s: %s; deleting it", sha1, exc)
                return _delete(dir_fd, name)
            with contextlib.suppress(OSError):
                fd = os.open(
                    dest + ".why",
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | fsdir.NOFOLLOW,
                    0o600,
                    dir_fd=qfd,
                )
                with os.fdopen(fd, "w") as fh:
                    fh.write(why[:4096] + "\n")
            try:  # the move happened: a failed trim must not hide it from the caller
                self._trim(qfd)
            except OSError as exc:
                log.warning("kvdisk: quarantine not trimmed: %s", exc)
        finally:
            os.close(qfd)
        log.warning("kvdisk: quarantined %s/%s.kv: %s", ns, sha1, why)
        return "moved"

    def _trim(self, qfd: int) -> None:
        files = []
        with os.scandir(qfd) as it:
            for de in it:
                if de.name.endswith(".kv") and de.is_file(follow_symlinks=False):
                    st = de.stat(follow_symlinks=False)
                    files.append((_moved_at(de.name), de.name, st.st_size))
        files.sort()
        total = sum(size for _, _, size in files)
        while files and (len(files) > MAX_FILES or total > self.max_bytes):
            _, name, size = files.pop(0)
            for victim in (name, name + ".why"):
                with contextlib.suppress(OSError):
                    os.unlink(victim, dir_fd=qfd)
            total -= size

    def files(self) -> list[str]:
        if self.root_fd < 0:
            return []
        try:
            fd = fsdir.open_dir(DIRNAME, self.root_fd)
        except OSError:
            return []
        try:
            with os.scandir(fd) as it:
                return sorted(
                    de.name
                    for de in it
                    if de.name.endswith(".kv") and de.is_file(follow_symlinks=False)
                )
        finally:
            fsdir.close_read(fd)


def _delete(dir_fd: int, name: str) -> str | None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("kvdisk: could not delete %s either: %s", name, exc)
        return None
    return "deleted"


def _moved_at(name: str) -> int:
    """When a file was quarantined, from its name (ns since the epoch; 0 for a name of an
    older kvdisk or of someone else, which goes first)."""
    parts = name[: -len(".kv")].split("-")
    if len(parts) == 4 and parts[2].isdigit():
        return int(parts[2])
    if len(parts) == 3 and parts[2].isdigit():  # <ns>-<sha1>-<unix time s>: older names
        return int(parts[2]) * 1_000_000_000
    return 0
