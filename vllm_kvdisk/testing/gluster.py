"""Make a GlusterFS volume on the local disk and mount it twice through FUSE: two clients
of one distributed file system, for the tests and benchmarks of replicas sharing a volume.

    with gluster.volume("/tmp/kvdisk-gluster") as vol:
        a, b = vol.mounts          # two mount points of one volume

Needs root, ``/dev/fuse`` and Debian's ``glusterfs-server`` and ``glusterfs-client``
(``.ci/run`` installs them). Everything lives under ``base``: glusterd's state, run
directory and logs (``/var/lib/glusterd`` is never used), the brick and the mount points.

* Set-up first removes what a killed run left under ``base``: its mounts, its glusterd and
  brick processes (by their pid files, and only if a pid's command line names ``base``, so
  a reused pid is never signalled), then the directory; so it can always be run again.
* Tear-down does the same, whatever failed before, and raises if something stays mounted
  (a directory is never deleted through a mount).
* glusterd's management port (24007) is fixed for every brick it starts, so one volume of
  this kind exists per machine at a time: ``LOCK`` is held for the volume's life (other
  runs wait for it) and names its ``base``, so the next run also cleans what a killed run
  left under another ``base``. A glusterd not started here (a system service) that holds
  the port is used as it is: the volume gets a name of its own and only that volume goes.
* Only what set-up creates is ever deleted (``glusterd.vol``, ``state``, ``run``, ``log``,
  ``brick``, the mount points), then ``base`` itself if it is empty.

Every failure raises :class:`GlusterError` with the reason and the end of the logs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

PORT = 24007
LOCK = "/tmp/kvdisk-gluster.lock"
PARTS = ("a", "b", "brick", "state", "run", "log", "glusterd.vol")
SYSTEM_SOCKET = "/var/run/glusterd.socket"
TOOLS = ("glusterd", "gluster", "mount.glusterfs")
CALL_TIMEOUT_S = 60.0


class GlusterError(RuntimeError):
    """The volume could not be set up or removed; the message says why."""


def missing() -> str | None:
    """Why a volume cannot be made on this machine, or None."""
    if os.geteuid() != 0:
        return "mounting a GlusterFS volume needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE is needed for the glusterfs client)"
    absent = [
        t
        for t in TOOLS
        if shutil.which(t, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None
    ]
    if absent:
        return (
            f"{', '.join(absent)} not installed (apt-get install glusterfs-server "
            "glusterfs-client; .ci/run does it)"
        )
    return None


def brick_dir(base: str) -> str:
    """The brick of the volume made under ``base``: the server's own copy of every file,
    on the local disk. What is really on the volume, without either client's caches (a
    test reads it, nothing writes it)."""
    return os.path.join(base, "brick", "b")


@dataclass
class Volume:
    base: str
    name: str
    mounts: tuple[str, str]
    socket_path: str  # glusterd's command socket
    own_glusterd: bool  # started here (else a glusterd that was running already)
    timings: dict[str, float] = field(default_factory=dict)

    def gluster(self, *args: str) -> str:
        return _gluster(self.socket_path, *args)

    def set(self, option: str, value: str) -> None:
        """``gluster volume set``: takes effect on the mounts without remounting."""
        self.gluster("volume", "set", self.name, option, value)


def _run(cmd: Sequence[str], what: str, timeout: float = CALL_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise GlusterError(f"{what}: {' '.join(cmd)} did not finish in {timeout:g} s") from None
    except OSError as exc:
        raise GlusterError(f"{what}: cannot run {cmd[0]}: {exc}") from None
    if done.returncode != 0:
        out = (done.stdout + done.stderr).strip()[-2000:]
        raise GlusterError(f"{what}: {' '.join(cmd)} exited with {done.returncode}: {out}")
    return done.stdout


def _gluster(sock: str, *args: str) -> str:
    return _run(
        ["gluster", "--mode=script", f"--glusterd-sock={sock}", *args],
        f"gluster {' '.join(args[:2])}",
    )


def _mounts_under(base: str) -> list[str]:
    """Mount points at or below ``base``, deepest first."""
    prefix = base.rstrip("/") + "/"
    found = []
    with open("/proc/self/mounts") as fh:
        for line in fh:
            point = line.split()[1].encode().decode("unicode_escape")  # \040 is a space
            if point == base or point.startswith(prefix):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def _pids_of(base: str) -> list[int]:
    """Processes started for ``base`` (pid files under it) still running, and only those
    whose command line names ``base``."""
    out = []
    for dirpath, _, names in os.walk(os.path.join(base, "run")):
        for name in names:
            if not name.endswith(".pid"):
                continue
            try:
                pid = int(open(os.path.join(dirpath, name)).read().strip() or 0)
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except (OSError, ValueError):
                continue
            if pid > 1 and base.encode() in cmdline:
                out.append(pid)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop(pids: list[int], timeout: float = 15.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not any(_alive(p) for p in pids):
            return


def _port_taken(port: int = PORT) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _port_holder(port: int = PORT) -> str:
    """Which process listens on ``port`` (for the message when it is not ours)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in open(table).read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
                    return f"pid {pid}: {cmd.decode(errors='replace').strip()}"
    return "a process not found in /proc"


def _log_tails(base: str, brick: str | None = None, limit: int = 1500) -> str:
    paths = []
    logdir = os.path.join(base, "log")
    if os.path.isdir(logdir):
        paths += [os.path.join(logdir, n) for n in sorted(os.listdir(logdir))]
    if brick:
        paths.append(_brick_log(brick))
    out = []
    for path in paths:
        with contextlib.suppress(OSError):
            lines = [
                ln
                for ln in open(path, errors="replace").read().splitlines()
                if "] E [" in ln or "] W [" in ln
            ]
            if lines:
                out.append(f"--- {path}:\n" + "\n".join(lines)[-limit:])
    return "\n".join(out)


def _brick_log(brick: str) -> str:
    return os.path.join("/var/log/glusterfs/bricks", brick.strip("/").replace("/", "-") + ".log")


def clean(base: str, *, name: str | None = None, sock: str | None = None) -> None:
    """Remove everything a volume under ``base`` may have left: mounts, processes, the
    volume ``name`` in a glusterd that was running already (its socket ``sock``), the
    directory. Raises GlusterError if a mount cannot be removed."""
    for point in _mounts_under(base):
        if subprocess.run(["umount", point], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True)
    if name and sock and os.path.exists(sock):
        with contextlib.suppress(GlusterError):
            _gluster(sock, "volume", "stop", name, "force")
        with contextlib.suppress(GlusterError):
            _gluster(sock, "volume", "delete", name)
    _stop(_pids_of(base))
    left = _mounts_under(base)
    if left:
        raise GlusterError(f"still mounted after umount: {left}")
    with contextlib.suppress(OSError):
        os.unlink(_brick_log(os.path.join(base, "brick", "b")))
    for part in PARTS:
        path = os.path.join(base, part)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(base)  # only if empty: nothing of anyone else's goes
    if any(os.path.lexists(os.path.join(base, p)) for p in PARTS):
        raise GlusterError(f"cannot remove what {base} holds")


def _glusterd_config(base: str, sock: str) -> str:
    return (
        "volume management\n"
        "    type mgmt/glusterd\n"
        f"    option working-directory {base}/state\n"
        f"    option run-directory {base}/run\n"
        f"    option glusterd-sockfile {sock}\n"
        "    option transport-type socket\n"
        f"    option transport.socket.listen-port {PORT}\n"
        "    option ping-timeout 0\n"
        "    option event-threads 1\n"
        "    option max-port 60999\n"
        "end-volume\n"
    )


def _start_glusterd(base: str, sock: str) -> None:
    for sub in ("state", "run", "log"):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
    vol = os.path.join(base, "glusterd.vol")
    with open(vol, "w") as fh:
        fh.write(_glusterd_config(base, sock))
    # glusterd daemonizes: it returns once its pid file is written.
    _run(
        [
            "glusterd",
            "-f",
            vol,
            "-p",
            os.path.join(base, "run", "glusterd.pid"),
            "-l",
            os.path.join(base, "log", "glusterd.log"),
        ],
        "starting glusterd",
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            _gluster(sock, "volume", "list")
            return
        except GlusterError as exc:
            if time.monotonic() > deadline:
                raise GlusterError(f"glusterd does not answer on {sock}: {exc}") from None
        time.sleep(0.1)


def _check_mounts(a: str, b: str) -> None:
    """A file written on one mount is read on the other (the volume works end to end)."""
    probe = f".probe-{os.getpid()}"
    with open(os.path.join(a, probe), "w") as fh:
        fh.write("ok")
    deadline = time.monotonic() + 10
    while True:
        try:
            if open(os.path.join(b, probe)).read() == "ok":
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise GlusterError(f"a file written on {a} is not read back on {b}")
        time.sleep(0.05)
    os.unlink(os.path.join(b, probe))


@contextlib.contextmanager
def _held(path: str, timeout_s: float) -> Iterator[int]:
    """The machine-wide lock (its descriptor: the file names the base in use)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise GlusterError(f"{path} belongs to someone else or others may write it")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise GlusterError(
                        f"{path} is held by another run for more than "
                        f"{timeout_s:g} s (one such volume per machine)"
                    ) from None
                time.sleep(0.5)
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def volume(
    base: str,
    *,
    name: str = "kvdisk",
    mount_options: Sequence[str] = (),
    options: dict[str, str] | None = None,
    wait_s: float = 1800.0,
) -> Iterator[Volume]:
    """A fresh volume on a brick under ``base``, mounted on ``base/a`` and ``base/b``
    (``mount_options``: extra ``-o`` options of both mounts; ``options``: ``gluster volume
    set`` before the start). Everything under ``base`` goes at the end."""
    reason = missing()
    if reason:
        raise GlusterError(reason)
    base = os.path.abspath(base)
    with _held(LOCK, wait_s) as lock_fd:
        t0 = time.perf_counter()
        previous = os.pread(lock_fd, 4096, 0).decode(errors="replace")
        if previous and previous != base and os.path.isabs(previous):
            clean(previous)  # a killed run's volume under another base
        clean(base)
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, base.encode(), 0)
        sock, own = os.path.join(base, "run", "glusterd.socket"), True
        if _port_taken():
            # Not ours (ours were stopped above): a glusterd that was running already.
            sock, own = SYSTEM_SOCKET, False
            name = f"{name}-{os.getpid()}"
        vol = Volume(base, name, (os.path.join(base, "a"), os.path.join(base, "b")), sock, own)
        brick = brick_dir(base)
        try:
            os.makedirs(os.path.dirname(brick), exist_ok=True)
            for point in vol.mounts:
                os.makedirs(point, exist_ok=True)
            if own:
                _start_glusterd(base, sock)
            else:
                try:
                    _gluster(sock, "volume", "list")
                except GlusterError:
                    raise GlusterError(
                        f"port {PORT} is held by {_port_holder()}, and no glusterd answers on "
                        f"{SYSTEM_SOCKET}: stop that process (a volume another run left "
                        "under another directory?)"
                    ) from None
            vol.timings["glusterd_s"] = time.perf_counter() - t0
            host = socket.gethostname()
            # force: the brick is on the root file system, which gluster warns about.
            vol.gluster("volume", "create", name, f"{host}:{brick}", "force")
            for key, value in (options or {}).items():
                vol.set(key, value)
            vol.gluster("volume", "start", name)
            opts = ["log-file=" + os.path.join(base, "log", "mount-{}.log"), *mount_options]
            for point, tag in zip(vol.mounts, "ab"):
                os.makedirs(os.path.join(base, "log"), exist_ok=True)
                _run(
                    [
                        "mount",
                        "-t",
                        "glusterfs",
                        "-o",
                        ",".join(opts).format(tag),
                        f"{host}:/{name}",
                        point,
                    ],
                    f"mounting {point}",
                )
            _check_mounts(*vol.mounts)
            vol.timings["setup_s"] = time.perf_counter() - t0
        except BaseException as exc:
            tails = _log_tails(base, brick)
            with contextlib.suppress(GlusterError):
                clean(base, name=None if own else name, sock=sock)
            if isinstance(exc, GlusterError):
                raise GlusterError(f"{exc}\n{tails}") from None
            raise
        try:
            yield vol
        finally:
            t1 = time.perf_counter()
            clean(base, name=None if own else name, sock=sock)
            os.ftruncate(lock_fd, 0)
            vol.timings["teardown_s"] = time.perf_counter() - t1
