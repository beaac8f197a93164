"""Cached pages are dropped before reading what another process wrote only where another
client's writes may be missing from them: a network volume, never a local disk.

On a local file system every process reads the one page cache, so a drop buys nothing;
and ``POSIX_FADV_DONTNEED`` of a file with dirty pages (the lock's count, the journal's
last line, a hit just written) drains every CPU's page lists and waits for each. With a
TP=2 engine's threads busy on both cores of this machine, one such call under the cache
lock took over a minute, and saves of both ranks waited behind it.
"""

from __future__ import annotations

import os

import numpy as np

from tests.synth import make, prompt, save
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage.store import Store


class Drops:
    """Records every request to drop cached pages (then makes it)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, int, int]] = []  # (file name, offset, length)
        real = os.posix_fadvise

        def fadvise(fd, offset, length, advice):
            if advice == os.POSIX_FADV_DONTNEED:
                name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
                self.calls.append((name, offset, length))
            return real(fd, offset, length, advice)

        monkeypatch.setattr(os, "posix_fadvise", fadvise)


def replicas_at_work(tmp_path) -> tuple[Store, Store]:
    """Two stores on one directory: saves, a refresh that follows the journal, an
    evicting save, hits; what every replica and TP rank does."""
    a, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    save(a, ns, prompt(1, vocab=256), 48, rng)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()  # from the journal a's save wrote
    save(a, ns, prompt(2, vocab=256), 48, rng)
    b.refresh(ns)
    b.space_bytes = b.index.total_bytes  # full: b's next save evicts
    save(b, ns, prompt(3, vocab=256), 48, rng)
    a.refresh(ns)
    for store in (a, b):
        live = sorted(e.sha1 for e in store.index.entries())
        store.touch(ns, live[0])
    assert b.stats.evicted >= 1
    assert {e.sha1 for e in a.index.entries()} == {e.sha1 for e in b.index.entries()}
    return a, b


def test_a_store_on_a_local_disk_never_drops_cached_pages(tmp_path, monkeypatch):
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert not fsdir.drops_cache(fd), fsdir.fs_type(fd)  # the tests' disk is local
    finally:
        os.close(fd)
    drops = Drops(monkeypatch)
    replicas_at_work(tmp_path)
    assert drops.calls == []


def test_a_network_volume_still_reads_what_other_clients_wrote(tmp_path, monkeypatch):
    """Where the mount table says FUSE (GlusterFS), the lock's count, the journal's new
    lines and a header's hits are read from the volume (tests/test_gluster.py proves the
    reads right on a real volume)."""
    monkeypatch.setattr(fsdir, "fs_type", lambda fd: "fuse.glusterfs")
    drops = Drops(monkeypatch)
    replicas_at_work(tmp_path)
    assert (".lock", 0, 0) in drops.calls  # the count, before each holder reads it
    assert any(n == ".journal" for n, _, _ in drops.calls)  # new lines, from the reader's page
    assert any(
        n.endswith(".kv") and o == 0 and n_ >= 4096  # a header, before a hit
        for n, o, n_ in drops.calls
    )
    assert all(offset % fsdir.PAGE == 0 and n % fsdir.PAGE == 0 for _, offset, n in drops.calls)


def test_a_drop_covers_every_page_its_range_touches(tmp_path, monkeypatch):
    """The kernel drops whole pages only: a partial first page is kept (rounded up), and
    so is a partial last page before the file's end (rounded down). With 64 KiB pages
    (some arm64 hosts), dropping a header's 4 KiB dropped nothing: hits through two
    mounts overwrote each other again."""
    monkeypatch.setattr(fsdir, "PAGE", 65536)
    drops = Drops(monkeypatch)
    path = tmp_path / "f"
    path.write_bytes(bytes(300_000))
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length in (
            (0, 4096),
            (100, 10),
            (70_000, 0),
            (65_536, 65_536),
            (60_000, 10_000),
        ):
            fsdir.drop_cached(fd, offset, length)
    finally:
        os.close(fd)
    assert [(o, n) for _, o, n in drops.calls] == [
        (0, 65536),
        (0, 65536),
        (65536, 0),
        (65536, 65536),
        (0, 131072),
    ]


def test_the_file_system_type_comes_from_the_mount_table(tmp_path, monkeypatch):
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        dev = os.fstat(fd).st_dev
        me = f"{os.major(dev)}:{os.minor(dev)}"
        table = tmp_path / "mountinfo"
        lines = [
            "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
            # optional fields before the separator; a mount point with an escaped space
            f"97 22 {me} / /mnt/kv\\040cache rw,relatime shared:7 master:2 - fuse.glusterfs"
            " localhost:/kv rw,user_id=0",
        ]
        table.write_text("\n".join(lines) + "\n")
        assert fsdir.fs_type(fd, str(table)) == "fuse.glusterfs"
        # Not in the table (a btrfs subvolume's device is not its mount's), a torn line, no
        # table: the type fstatfs gives (this disk: local).
        table.write_text(lines[0] + "\n")
        assert fsdir._mount_type(fd, str(table)) is None
        assert fsdir.fs_type(fd, str(table)) == fsdir._statfs_type(fd) in fsdir.LOCAL_FS
        table.write_text(f"97 22 {me} / /mnt rw\n")
        assert fsdir._mount_type(fd, str(table)) is None
        assert fsdir._mount_type(fd, str(tmp_path / "missing")) is None
        for kind, drops in (
            ("nfs4", True),
            ("ceph", True),
            ("fuse.glusterfs", True),
            (None, True),
            ("ext4", False),
            ("xfs", False),
            ("tmpfs", False),
        ):
            monkeypatch.setattr(fsdir, "fs_type", lambda _fd, k=kind: k)
            assert fsdir.drops_cache(fd) is drops, kind
    finally:
        os.close(fd)
