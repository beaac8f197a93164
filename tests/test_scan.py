"""Scans and refreshes: the index follows the directory (files other processes added,
deleted or replaced, within one timestamp tick too); only what is proven corrupt in our
version is quarantined; I/O errors never escape."""

import os
import time

import numpy as np
import pytest
from synth import child_of_a_root, encode, make, prompt, save

from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify


def test_a_parent_deleted_within_one_timestamp_tick_is_still_seen_gone(tmp_path, monkeypatch):
    """The index notices other processes' changes by the directory's mtime, and file
    system timestamps are coarse (a jiffy on ext4, a second on some): when this store's
    last refresh, its own temp file and another replica's eviction of the parent fall in
    one tick, the mtime says "unchanged" and the child used to be committed as an orphan.
    The utimes pin that tick: the directory's mtime is "now" when this store looks, and
    stays so through the eviction and the temp file."""
    from vllm_kvdisk.storage import fsdir

    store, ns, p, root, plan, rng = child_of_a_root(tmp_path, 8)
    seen = time.time_ns()
    os.utime(store.ns_dir(ns), ns=(seen, seen))
    store.refresh(ns)  # the look, within the tick of the directory's last change
    other = Store(store.root, space_bytes=1 << 30)
    other.scan()
    other.remove_file(ns, root.sha1)  # another replica evicts the parent
    write = fsdir.TempFile.write

    def same_tick(self, buffers):  # noqa: ANN001, ANN202
        written = write(self, buffers)
        os.utime(store.ns_dir(ns), ns=(seen, seen))
        return written

    monkeypatch.setattr(fsdir.TempFile, "write", same_tick)
    from synth import pages

    with pytest.raises(SaveSkipped, match="parent_gone"):
        store.write(ns, plan.sha1, encode(plan, p, pages(rng, plan)))
    assert not os.path.exists(store.path(ns, plan.sha1))
    assert verify(store).ok


def test_a_file_another_replica_adds_within_one_tick_is_found(tmp_path):
    """The lookup side of the same tick: a checkpoint another replica lands in the tick of
    this store's last look used to stay unseen until the directory changed again."""
    store, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    save(store, ns, prompt(9), 48, rng)
    seen = time.time_ns()
    os.utime(store.ns_dir(ns), ns=(seen, seen))
    store.refresh(ns)
    other = Store(store.root, space_bytes=1 << 30)
    other.scan()
    added, _ = save(other, ns, prompt(10), 48, rng)
    os.utime(store.ns_dir(ns), ns=(seen, seen))  # its rename in the same tick
    store.refresh(ns)
    assert store.index.get(ns, added.sha1) is not None


def test_entries_learned_from_reports_follow_the_directory(tmp_path):
    """The scheduler learns of the worker's files from its reports; a file deleted or
    replaced by another process (kvdisk gc, verify --fix, a replica) must leave its index,
    or every load of it fails and the key can never be saved again."""
    worker, ns = make(tmp_path)
    sched = Store(worker.root, space_bytes=1 << 30)
    sched.scan()
    rng = np.random.default_rng(0)
    p = prompt(40)
    a, _ = save(worker, ns, p, 48, rng)
    sched.index.add(worker.index.get(ns, a.sha1))  # what a WorkerReport carries
    sched.refresh(ns)
    assert sched.index.get(ns, a.sha1) is not None
    os.unlink(worker.path(ns, a.sha1))  # deleted by hand, not journaled
    sched.refresh(ns)
    assert sched.index.get(ns, a.sha1) is None
    # Replaced under the same name by another replica: re-indexed, not "inconsistent".
    worker.refresh(ns, force=True)  # a store following the journal lists when told to
    b, _ = save(worker, ns, p, 48, rng)
    sched.refresh(ns)
    old = sched.index.get(ns, b.sha1)
    other = Store(worker.root, space_bytes=1 << 30)
    other.scan()
    held = os.open(worker.path(ns, b.sha1), os.O_RDONLY)  # a reader keeps the old inode alive
    other.remove_file(ns, b.sha1)
    save(other, ns, p, 48, np.random.default_rng(1))
    sched.refresh(ns)
    new = sched.index.get(ns, b.sha1)
    os.close(held)
    assert new is not None and new.inode != old.inode
    # A quarantine decided on the old file never moves the sound replacement.
    assert not sched.quarantine(ns, b.sha1, "checksum mismatch", inode=old.inode)
    assert os.path.exists(worker.path(ns, b.sha1)) and verify(sched).ok


def test_scans_quarantine_only_what_is_proven_corrupt_in_our_version(tmp_path, monkeypatch):
    """A rolling upgrade shares the volume with another format version, and a network file
    system can fail a read now and then: neither is evidence of corruption."""
    store, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    a, _ = save(store, ns, prompt(50), 48, rng)
    b, _ = save(store, ns, prompt(51), 48, rng)
    raw = bytearray(open(store.path(ns, a.sha1), "rb").read())
    raw[3] = 3  # format version 3: a newer build's file
    open(store.path(ns, a.sha1), "wb").write(raw)
    real_open = os.open
    failing = {"left": 1}

    def flaky(path, flags, *args, **kwargs):
        if isinstance(path, str) and path == f"{b.sha1}.kv" and failing["left"]:
            failing["left"] -= 1
            raise OSError(116, "Stale file handle")  # ESTALE, once
        return real_open(path, flags, *args, **kwargs)

    import vllm_kvdisk.storage.store as store_mod

    monkeypatch.setattr(store_mod.os, "open", flaky)
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()
    assert fresh.index.get(ns, b.sha1) is None and fresh.stats.unreadable == 1
    assert fresh.quarantined_files() == []  # neither file moved
    assert os.path.exists(store.path(ns, a.sha1)) and os.path.exists(store.path(ns, b.sha1))
    fresh.refresh(ns)  # the transient error is tried again
    assert fresh.index.get(ns, b.sha1) is not None and fresh.index.get(ns, a.sha1) is None
    assert any("unsupported" in why for _, _, why in fresh.rejected)


def test_io_errors_never_escape_a_refresh(tmp_path, monkeypatch):
    store, ns = make(tmp_path)
    save(store, ns, prompt(60), 48, np.random.default_rng(0))
    import vllm_kvdisk.storage.store as store_mod

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store_mod.os, "scandir", broken)
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()  # logs, indexes nothing, raises nothing
    assert len(fresh.index) == 0
    assert fresh.refresh(ns, force=True) is False
