"""Reads from a slower disk: this process's reads from the block device under a path,
capped by the kernel's block-I/O throttle (cgroup v1 ``blkio.throttle.read_bps_device``
or cgroup v2 ``io.max``), for benchmarks that compare restores on disks of other speeds.

    with throttled_reads(path, 900_000_000) as why:
        if why: print("not measured:", why)   # no root, no block device, no controller

Every thread of the process is moved into a fresh cgroup for the block and moved back
after it. The kernel's throttle lets a short burst through after a limit is set, so the
first read in the block should be a warm-up. Root only; nothing is changed where any step
is refused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

V1 = "/sys/fs/cgroup/blkio"
V2_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")


def _disk_of(path: str) -> str:
    """``major:minor`` of the whole disk holding ``path`` (a throttle is set on a disk,
    not on one of its partitions)."""
    dev = os.stat(path).st_dev
    node = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.exists(node):
        raise OSError(f"{path} is not on a block device (tmpfs, overlay or a network mount)")
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.join(os.path.realpath(node), "..")
    with open(os.path.join(node, "dev")) as f:
        return f.read().strip()


def _own(controller_root: str, v1_name: str | None) -> str:
    """The cgroup this process is in, under ``controller_root``."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if (v1_name is None and names == "") or (v1_name in names.split(",")):
                return os.path.join(controller_root, path.lstrip("/"))
    raise OSError("this process's cgroup is not listed")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def throttled_reads(path: str, bytes_per_s: int) -> Iterator[str]:
    """Yield "" with reads from ``path``'s disk capped at ``bytes_per_s`` for this
    process, or the reason it could not be done (and nothing capped)."""
    try:
        disk = _disk_of(path)
        if os.path.exists(os.path.join(V1, "blkio.throttle.read_bps_device")):
            home = _own(V1, "blkio")
            group = os.path.join(V1, f"kvdisk-bench-{os.getpid()}")
            rule, value = "blkio.throttle.read_bps_device", f"{disk} {bytes_per_s}"
        else:
            root = next(
                (r for r in V2_ROOTS if os.path.exists(os.path.join(r, "cgroup.controllers"))),
                None,
            )
            if root is None:
                raise OSError("no block-I/O cgroup controller")
            with open(os.path.join(root, "cgroup.controllers")) as f:
                if "io" not in f.read().split():
                    raise OSError("no block-I/O cgroup controller")
            home = _own(root, None)
            group = os.path.join(root, f"kvdisk-bench-{os.getpid()}")
            rule, value = "io.max", f"{disk} rbps={bytes_per_s}"
        os.mkdir(group)
    except OSError as exc:
        yield f"{exc}"
        return
    try:
        _write(os.path.join(group, rule), value)
        _write(os.path.join(group, "cgroup.procs"), str(os.getpid()))
    except OSError as exc:
        os.rmdir(group)
        yield f"the throttle was refused: {exc}"
        return
    try:
        yield ""
    finally:
        _write(os.path.join(home, "cgroup.procs"), str(os.getpid()))
        os.rmdir(group)
