"""Safe file-system primitives for a cache directory that others may share or tamper with.

* Every path is opened relative to a directory descriptor with ``O_NOFOLLOW``: a symlink
  planted as a ``.kv`` file, a namespace, the quarantine or the lock file is never
  followed, so nothing is read from or written outside the root.
* Every file is opened through :func:`open_regular`: ``O_NONBLOCK`` so a FIFO (or a
  device) named like one of our files cannot block the open, then ``fstat`` on the
  descriptor refuses anything that is not a regular file (:class:`NotRegularFile`). A
  file with other hard links is never opened for writing: its other names may be
  outside the root.
* Writes go to a temp file in the same directory, locked (``flock``) by its writer while
  it is written, fsynced, then renamed into place and the directory fsynced. A temp file
  that nobody holds a lock on belongs to a dead writer and may be deleted at once; a live
  writer's temp file is never touched.
* The cross-process lock (``ROOT/.lock``) is taken with a timeout: a stuck network file
  system costs one skipped save, never a stalled engine.
* A descriptor a file was only read through is closed with :func:`close_read`: the
  bytes were read already, and an error ``close`` reports then is not the read's (a
  FUSE file system answers the close's flush: GlusterFS's client said ENOENT once another
  process had replaced ``namespace.json`` by a rename, which failed the save that read it).
* Cached pages are dropped before a read of what another process wrote (the lock's count,
  the journal's lines, a header's hits) only where another client's writes may not be in
  them: not on a local file system, whose page cache is the one copy every process reads
  (``drops_cache``). There the drop bought nothing and cost much: ``POSIX_FADV_DONTNEED``
  of a file with dirty pages drains every CPU's page lists and waits for each; with the
  engine's threads busy on both cores, one such call held the lock for a minute.

Pure: standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Buffer

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
TMP_PREFIX = ".tmp-"
TMP_GRACE_S = 10.0  # a temp file younger than this may be one whose writer has not locked it yet
PAGE = os.sysconf("SC_PAGE_SIZE")
IOV_MAX = 1024  # iovecs per preadv/writev call (Linux's limit)


def close_read(fd: int) -> None:
    """Close a descriptor that was only read through; an error the close reports (the
    file system's flush of a file another process replaced or removed) is not one of the
    read, which is done. EBADF stays an error: a descriptor closed twice is our bug."""
    try:
        os.close(fd)
    except OSError as exc:
        if exc.errno == errno.EBADF:
            raise


class NotRegularFile(OSError):
    """An entry named like one of our files is a FIFO, socket, device node or directory
    (or, for writing, a file with other hard links): never ours, never read or written.
    ``inode``: what ``fstat`` said, so a scan can remember it as skipped."""

    def __init__(self, code: int, message: str, inode: int = 0):
        super().__init__(code, message)
        self.inode = inode


_KIND_NAMES = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)


def open_regular(
    name: str,
    dir_fd: int | None = None,
    *,
    flags: int = os.O_RDONLY,
    mode: int = 0o600,
    single_link: bool = False,
) -> int:
    """Open ``name`` (in ``dir_fd``) only if it is a regular file, never through a symlink,
    never blocking on the open: a FIFO opened for reading without ``O_NONBLOCK`` waits for
    a writer forever (a scan under the cache lock would hold the lock forever). ``O_NOCTTY``:
    a terminal device named like our file never becomes this process's terminal.
    ``single_link``: refuse a file with other hard links too (before writing in place).
    The descriptor returned is blocking again. OSError, NotRegularFile for other kinds."""
    try:
        fd = os.open(name, flags | os.O_NONBLOCK | os.O_NOCTTY | NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket, a device without its driver, a FIFO to write
            raise NotRegularFile(
                errno.ENXIO, f"{name} is not a regular file (a socket, a FIFO or a device)"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((what for test, what in _KIND_NAMES if test(st.st_mode)), "not a file")
            raise NotRegularFile(errno.EINVAL, f"{name} is not a regular file ({kind})", st.st_ino)
        if single_link and st.st_nlink > 1:
            raise NotRegularFile(
                errno.EMLINK,
                f"{name} has {st.st_nlink} hard links: never written in place",
                st.st_ino,
            )
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


class LockTimeout(OSError):
    """The cache directory's lock could not be taken in time."""


class UnsafeDirectory(OSError):
    """The cache directory is writable by others, or owned by another user."""


def check_root(path: str, *, allow_shared: bool) -> None:
    """Refuse a root that another user could tamper with (unless explicitly allowed)."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(errno.ENOTDIR, f"{path} is not a directory")
    if allow_shared:
        return
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(
            errno.EPERM,
            (
                f"{path} is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()}): "
                "another user could plant or change checkpoints. Use a directory of your own, "
                "or allow it explicitly (kv_disk_allow_shared_dir)"
            ),
        )
    if st.st_mode & 0o022:
        raise UnsafeDirectory(
            errno.EPERM,
            (
                f"{path} is writable by its group or by everyone "
                f"(mode {stat.S_IMODE(st.st_mode):o}): "
                "another user could plant or change checkpoints. chmod go-w it, use a private "
                "subdirectory, or allow it explicitly (kv_disk_allow_shared_dir)"
            ),
        )


def open_dir(name: str, dir_fd: int | None = None) -> int:
    """A descriptor of a real directory (never through a symlink)."""
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW, dir_fd=dir_fd)


def make_dirs(path: str) -> None:
    """``os.makedirs(path)`` with every directory it creates 0700: ``makedirs``' mode is
    the leaf's only, its parents get 0777 minus the umask (0777 under umask 000)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if parent != path and not os.path.isdir(parent):
        make_dirs(parent)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)


def make_dir(name: str, dir_fd: int) -> int:
    """Create (0700) or open the real directory ``name`` inside ``dir_fd``."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    return open_dir(name, dir_fd)


def same_dir(fd: int, name: str, parent_fd: int) -> bool:
    """Whether ``fd`` is still the directory called ``name`` (not renamed or replaced)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError:
        return False
    try:
        mine = os.fstat(fd)
    except OSError:  # ESTALE: a network file system's handle of a directory deleted since
        return False
    return stat.S_ISDIR(st.st_mode) and (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev)


def writev_all(fd: int, buffers: Sequence[Buffer]) -> int:
    total = 0
    views = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
    head = 0
    while head < len(views):
        n = os.writev(fd, views[head : head + IOV_MAX])
        total += n
        while head < len(views) and n >= views[head].nbytes:
            n -= views[head].nbytes
            head += 1
        if n:
            views[head] = views[head][n:]
    return total


class TempFile:
    """A locked temp file in ``dir_fd``: write, then ``commit`` it under its final name.

    Whatever happens before ``commit`` succeeds, ``close`` removes the temp file."""

    def __init__(self, dir_fd: int, final: str):
        self.dir_fd = dir_fd
        self.final = final
        self.name = f"{TMP_PREFIX}{final}-{os.getpid()}-{secrets.token_hex(6)}"
        self.fd = os.open(
            self.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600, dir_fd=dir_fd
        )
        self.committed = False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # no flock here (some network file systems): the age grace still applies

    def write(self, buffers: Sequence[Buffer]) -> int:
        written = writev_all(self.fd, buffers)
        os.fsync(self.fd)
        return written

    def rewind(self) -> None:
        """Drop what was written (e.g. after ENOSPC) and start again at offset 0."""
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)

    def stat(self) -> os.stat_result:
        return os.fstat(self.fd)

    def commit(self) -> None:
        os.replace(self.name, self.final, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        self.committed = True
        os.fsync(self.dir_fd)

    def close(self) -> None:
        if not self.committed:
            with contextlib.suppress(OSError):
                os.unlink(self.name, dir_fd=self.dir_fd)
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __enter__(self) -> TempFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_atomic(dir_fd: int, name: str, buffers: Sequence[Buffer]) -> int:
    """Write ``name`` in ``dir_fd`` atomically (temp file, fsync, rename, fsync dir)."""
    with TempFile(dir_fd, name) as tmp:
        written = tmp.write(buffers)
        tmp.commit()
    return written


def writer_gone(dir_fd: int, name: str, now: float | None = None) -> bool:
    """Whether the writer of a file it keeps locked while alive (a temp file, a tool-call
    log) is gone: nobody holds the lock and the file is not brand new."""
    try:
        fd = open_regular(name, dir_fd)
    except OSError:
        return False  # gone, or not a regular file: not a writer's file to remove
    try:
        st = os.fstat(fd)
        if (now if now is not None else time.time()) - st.st_mtime < TMP_GRACE_S:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its writer is alive
        except OSError:
            pass  # no flock on this file system: the age alone decides
        return True
    finally:
        close_read(fd)


@contextlib.contextmanager
def locked(
    dir_fd: int,
    timeout_s: float,
    name: str = ".lock",
    *,
    drop_cache: bool = True,
    readonly: bool = False,
) -> Iterator[int]:
    """Hold the exclusive cross-process lock file ``name`` of ``dir_fd``, waiting at most
    ``timeout_s``; LockTimeout otherwise. Each call opens its own descriptor, so threads
    of one process exclude each other too. Yields that descriptor: the lock file's bytes
    are the holder's to read and write (``drop_cache``: read from the volume, see
    ``drops_cache``). ``readonly``: opened for reading, never created (a ``flock`` needs
    no write access); FileNotFoundError where there is none."""
    flags = os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT
    fd = open_regular(name, dir_fd, flags=flags)
    try:
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(
                        errno.ETIMEDOUT, f"cache lock not taken within {timeout_s:g} s"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        # The holder reads what the last holder wrote (the change count). A network file
        # system's client may keep this file's pages from before: GlusterFS's FUSE client
        # did, and each mount read its own count. Dropping them makes the read ask the
        # volume.
        if drop_cache:
            drop_cached(fd)
        yield fd
    finally:
        os.close(fd)


# Local file systems: one page cache per file on the host, coherent with every write. On
# anything else (NFS, CephFS, FUSE mounts such as GlusterFS, an unknown type) a client may
# read pages it cached before another client wrote.
LOCAL_FS = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "tmpfs",
        "ramfs",
        "overlay",
        "zfs",
        "f2fs",
        "bcachefs",
        "jfs",
        "reiserfs",
        "nilfs2",
    }
)


# statfs(2) magic numbers of the types above and of the network ones (linux/magic.h).
FS_MAGIC = {
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlay",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0xCA451A4E: "bcachefs",
    0x3153464A: "jfs",
    0x52654973: "reiserfs",
    0x3434: "nilfs2",
    0x6969: "nfs",
    0x65735546: "fuse",
    0x00C36400: "ceph",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x01021997: "v9fs",
    0x0BD00BD0: "lustre",
    0x01161970: "gfs2",
    0x7461636F: "ocfs2",
}


def _statfs_type(fd: int) -> str | None:
    """The type ``fstatfs(2)`` gives (its first field, ``f_type``), named; None where it
    cannot be asked or the magic is not known here."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on 64-bit Linux
        if libc.fstatfs(ctypes.c_int(fd), buf) != 0:
            return None
        magic = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    except (OSError, AttributeError, ValueError):
        return None
    return FS_MAGIC.get(magic)


def fs_type(fd: int, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system ``fd`` is on, as the mount table says (None: unknown),
    else as ``fstatfs`` says (a btrfs subvolume's device is not the one its mount lists)."""
    return _mount_type(fd, mountinfo) or _statfs_type(fd)


def _mount_type(fd: int, mountinfo: str) -> str | None:
    try:
        dev = os.fstat(fd).st_dev
        want = f"{os.major(dev)}:{os.minor(dev)}"
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                # id parent major:minor root mount-point options [optional...] - type ...
                fields = line.split()
                if len(fields) > 7 and fields[2] == want and "-" in fields[6:]:
                    return fields[fields.index("-", 6) + 1]
    except (OSError, ValueError, IndexError):
        return None
    return None


def drops_cache(fd: int) -> bool:
    """Whether reads on this file system must drop cached pages to see another client's
    writes: not on a local one (see the module docstring), yes on any other or unknown."""
    return fs_type(fd) not in LOCAL_FS


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Make the next read of ``[offset, offset + length)`` (0: to the end) ask the volume,
    not cached pages. The kernel drops whole pages only, rounding a partial first page
    *up* and a partial last page (not at the file's end) *down*: the range is widened to
    the pages it touches (64 KiB pages on some arm64 hosts: a 4 KiB range dropped
    nothing). Callers ask only where ``drops_cache``."""
    start = offset - offset % PAGE
    end = 0 if not length else -(-(offset + length) // PAGE) * PAGE
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, start, end - start if length else 0, os.POSIX_FADV_DONTNEED)


RACY_NS = 50_000_000  # above any kernel's timestamp tick (jiffies: 1-10 ms)


def racy(mtime_ns: int, looked_ns: int | None) -> bool:
    """Whether a directory whose mtime was read at ``looked_ns`` may still change without
    that mtime moving: timestamps are coarse (a jiffy on ext4, a second on some file
    systems), so a change in the same tick as the look leaves the same mtime. Such an
    mtime is not remembered, and the next refresh lists the directory again.
    ``looked_ns`` is the file system's own time (``Directory.now_ns``: the clock that
    stamped the mtime), never this host's, which may run ahead of the file server's and
    make a change of the same tick look old; None (unknown): racy."""
    if looked_ns is None:
        return True
    tick = 1_000_000_000 if mtime_ns % 1_000_000_000 == 0 else RACY_NS
    return looked_ns - mtime_ns < tick


def identity(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one file from another under one name: its inode alone does not, since a
    freed inode is handed to the next file at once (ext4); a new file there has another
    size or mtime, and a header changed in place (hits) has another mtime."""
    return st.st_ino, st.st_size, st.st_mtime_ns


def same_file(dir_fd: int, name: str, known: Any) -> bool:
    """Whether ``name`` in ``dir_fd`` still is the file ``known`` (an index entry: its
    inode, size and mtime_ns) was (``identity``)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return identity(st) == (known.inode, known.size, known.mtime_ns)


def still_there(dir_fd: int, name: str, known: Any, *, ask_volume: bool) -> bool:
    """``same_file``, for a file a listing did not show. ``ask_volume`` (a network file
    system, ``drops_cache``): a client's stat, open and cached reads may answer for a
    second after another client deleted the file (GlusterFS's did, all three); a read of
    its first byte after dropping its cached pages goes to the server, which answers
    ESTALE for a file that is gone."""
    if not same_file(dir_fd, name, known):
        return False
    if not ask_volume:
        return True
    try:
        fd = open_regular(name, dir_fd)
    except OSError:
        return False
    try:
        drop_cached(fd, 0, 1)
        os.pread(fd, 1, 0)
    except OSError:
        return False
    finally:
        close_read(fd)
    return True
