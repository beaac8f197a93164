"""The index never lies about the disk: a dropped entry is listed again, every removal is
counted and journaled, errors stay with their namespace and file, a journal is known by
more than its inode, nothing in the cache directory stops a store, and the quarantine
keeps its newest evidence."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil

import numpy as np
import pytest

from tests.synth import FP, make, planner, prompt, save
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.storage import scan as scan_mod
from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.journal import NAME
from vllm_kvdisk.storage.quarantine import DIRNAME, Quarantine
from vllm_kvdisk.storage.store import Store


def view(store: Store) -> set[tuple]:
    return {
        (e.ns, e.sha1, e.tokens, e.parent, e.parent_tokens, e.size, e.inode, e.mtime_ns)
        for e in store.index.entries()
    }


def truth(root: str) -> set[tuple]:
    fresh = Store(root, space_bytes=1 << 30)
    fresh.scan()
    return view(fresh)


def on_disk_orphans(root: str) -> list:
    fresh = Store(root, space_bytes=1 << 30)
    fresh.scan()
    return fresh.index.orphans()


def settled(store: Store, *namespaces: str) -> None:
    """Date the namespace directories back and let ``store`` remember them: a directory
    changed within a timestamp tick is listed at every refresh (``fsdir.racy``), which
    would hide a refresh that trusts an unchanged mtime."""
    for ns in namespaces:
        os.utime(store.ns_dir(ns), ns=(10**18, 10**18))
        store.refresh(ns, force=True)
    caught_up(store)


def caught_up(store: Store) -> None:
    """What every save does first: under the lock, bring the index up to the count."""
    with store.lock.hold(), store._mutex:
        store.scanner.catch_up()


def two_namespaces(tmp_path, **kw):
    store, a = make(tmp_path, **kw)
    b = store.ensure_namespace(dataclasses.replace(FP, model="other"))
    return store, a, b


# -- 1: a forgotten entry makes its namespace's next listing real -------------------


def test_a_forgotten_file_is_listed_again_and_its_parent_is_never_a_leaf(tmp_path):
    """A load failure (EIO) dropped the delta from the index; the namespace kept its
    directory mtime, so the next catch-up skipped it and called the index whole. Saves
    in another namespace then evicted the delta's parent as a leaf: an orphan."""
    store, a, b = two_namespaces(tmp_path)
    rng = np.random.default_rng(0)
    p = prompt(1, vocab=256)
    root, _ = save(store, a, p, 48, rng)
    delta, _ = save(store, a, p, 112, rng)
    settled(store, a)
    store.forget(a, delta.sha1)  # what a failed load does
    caught_up(store)
    assert store.index.get(a, delta.sha1) is not None  # listed again
    assert view(store) == truth(store.root)
    store.space_bytes = store.index.total_bytes + 1  # full: saves in b evict
    save(store, b, prompt(2, vocab=256), 48, rng)
    save(store, b, prompt(3, vocab=256), 48, rng)
    assert on_disk_orphans(store.root) == []
    assert view(store) == truth(store.root)


def test_a_store_is_not_whole_while_a_forgotten_file_is_on_disk(tmp_path):
    """The store that forgot a file compacted the journal without it, and a replica
    starting from that snapshot never knew the file."""
    store, a, b = two_namespaces(tmp_path)
    rng = np.random.default_rng(0)
    kept, _ = save(store, a, prompt(1, vocab=256), 48, rng)
    settled(store, a)
    store.forget(a, kept.sha1)
    save(store, b, prompt(2, vocab=256), 48, rng)
    store.scanner.write_snapshot(1.0)  # a whole store writes one; this one is not whole
    other = Store(store.root, space_bytes=1 << 30)
    assert other.scanner.start()
    assert other.index.get(a, kept.sha1) is not None


# -- 2: every removal is counted and journaled ----------------------------------------


@pytest.mark.parametrize("fault", ["plain file", "symlink", "rename EXDEV", "trim raises"])
def test_every_quarantine_removal_is_journaled(tmp_path, monkeypatch, fault):
    """The quarantine's fallback deleted the name in place without counting or
    journaling it; a trim that raised after the move skipped the journal line too.
    Other replicas kept offering and budgeting the file."""
    a, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    bad, _ = save(a, ns, prompt(1, vocab=256), 48, rng)
    save(a, ns, prompt(2, vocab=256), 48, rng)
    qpath = os.path.join(a.root, DIRNAME)
    if fault == "plain file":
        open(qpath, "wb").write(b"not a directory")
    elif fault == "symlink":
        os.symlink(str(tmp_path), qpath)
    elif fault == "rename EXDEV":
        real = os.rename

        def rename(src, dst, **kw):
            if str(src).endswith(".kv"):
                raise OSError(errno.EXDEV, "cross-device link")
            return real(src, dst, **kw)

        monkeypatch.setattr(os, "rename", rename)
    else:

        def trim(self, qfd):
            raise OSError(errno.EIO, "EIO listing the quarantine")

        monkeypatch.setattr(Quarantine, "_trim", trim)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    a.quarantine(ns, bad.sha1, "checksum mismatch")
    assert not os.path.exists(a.path(ns, bad.sha1))
    b.refresh(ns)
    assert b.scanner.journaled() and b.index.get(ns, bad.sha1) is None
    assert view(b) == view(a) == truth(a.root)


# -- 3: errors per namespace and per file ---------------------------------------------


def test_one_unlistable_namespace_does_not_stop_the_listing_of_the_others(tmp_path, monkeypatch):
    """The background listing had one try around its loop: EACCES on one namespace
    stopped it for every namespace after it."""
    a, first, second = two_namespaces(tmp_path)
    first, second = sorted([first, second])
    rng = np.random.default_rng(0)
    save(a, first, prompt(1, vocab=256), 48, rng)
    monkeypatch.setattr(a.scanner.journal, "append", lambda change: False)
    monkeypatch.setattr(a.scanner.journal, "compact", lambda count, entries: False)
    missed, _ = save(a, second, prompt(2, vocab=256), 48, rng)  # no line: a killed writer
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    real = b.scanner._list
    bad_fd = b.directory.namespace(first).fd

    def listing(dir_fd):
        if os.path.samestat(os.fstat(dir_fd), os.fstat(bad_fd)):
            raise PermissionError(errno.EACCES, "permission denied")
        return real(dir_fd)

    monkeypatch.setattr(b.scanner, "_list", listing)
    b.scanner.reconcile()
    assert b.index.get(second, missed.sha1) is not None


def test_an_unreadable_file_is_known_bad_the_index_whole_and_its_parent_kept(tmp_path, monkeypatch):
    """A file that stays unreadable (EIO) made every listing a gap: never whole again,
    no snapshot, a listing of every namespace at every save; and its parent, a leaf in
    the index, was evicted."""
    store, a, b = two_namespaces(tmp_path)
    rng = np.random.default_rng(0)
    p = prompt(1, vocab=256)
    parent, _ = save(store, a, p, 48, rng)
    child, _ = save(store, a, p, 112, rng)
    real = scan_mod.read_indexable

    def read(dir_fd, sha1):
        if sha1 == child.sha1:
            return OSError(errno.EIO, "I/O error"), -1
        return real(dir_fd, sha1)

    monkeypatch.setattr(scan_mod, "read_indexable", read)
    settled(store, a)
    store.forget(a, child.sha1)  # its load failed with EIO
    caught_up(store)
    assert store.scanner.journaled()  # whole again, the file known bad
    assert store.index.get(a, child.sha1) is None  # never offered
    on_disk = sum(os.path.getsize(store.path(a, e.sha1)) for e in (parent, child))
    store.space_bytes = on_disk + 15000  # room for one file of b: the next ones evict
    for seed in range(2, 5):
        save(store, b, prompt(seed, vocab=256), 48, rng)
    assert os.path.exists(store.path(a, parent.sha1))
    assert on_disk_orphans(store.root) == []


def test_a_file_never_read_does_not_keep_the_index_from_being_whole(tmp_path, monkeypatch):
    store, a, b = two_namespaces(tmp_path)
    rng = np.random.default_rng(0)
    bad, _ = save(store, a, prompt(1, vocab=256), 48, rng)
    real = scan_mod.read_indexable
    monkeypatch.setattr(
        scan_mod,
        "read_indexable",
        lambda fd, sha1: (
            (OSError(errno.EIO, "I/O error"), -1) if sha1 == bad.sha1 else real(fd, sha1)
        ),
    )
    fresh = Store(store.root, space_bytes=1 << 30)
    os.unlink(os.path.join(store.root, NAME))
    fresh.start(background=False)
    assert fresh.index.get(a, bad.sha1) is None
    save(fresh, b, prompt(2, vocab=256), 48, rng)
    assert fresh.scanner.journaled()
    assert os.path.exists(os.path.join(store.root, NAME))


# -- 4: a journal known by more than its inode --------------------------------------


def test_a_journal_rewritten_on_the_same_inode_is_read_from_its_start(tmp_path):
    """ext4 hands a freed inode to the next file: after two compactions the journal was
    the inode a reader remembered, read from its old offset: nothing new, "whole" over a
    stale index. The reuse is made here by renaming the old inode back over the name
    with the new journal's bytes."""
    a, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    for seed in range(8):
        save(a, ns, prompt(seed, vocab=256), 48, rng)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    path = os.path.join(a.root, NAME)
    keep = os.path.join(a.root, "old-journal")
    os.link(path, keep)  # the old inode, kept for the reuse below
    for entry in list(a.index.entries())[:6]:
        a.remove_file(ns, entry.sha1)
    save(a, ns, prompt(9, vocab=256), 48, rng)
    assert a.scanner.write_snapshot(1.0)  # shorter than what b read of the old one
    with open(keep, "r+b") as fh:  # the new journal's bytes on the old inode
        fh.truncate(0)
        fh.write(open(path, "rb").read())
    os.rename(keep, path)
    b.refresh(ns)
    assert view(b) == truth(a.root)
    save(b, ns, prompt(20, vocab=256), 48, rng)  # b appends where readers look
    a.refresh(ns)
    assert a.scanner.journaled() and view(a) == view(b) == truth(a.root)


# -- 5: a catch-up listing compares identity, not inodes ------------------------------


def test_a_name_resaved_on_its_old_inode_is_read_again_by_a_catch_up(tmp_path, monkeypatch):
    """After a gap the catch-up listing compared inodes only: a root another replica
    evicted and saved again as a delta, on the inode it freed, kept its stale "root"
    entry, and its real parent looked like a leaf and was evicted: an orphan."""
    a, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    p = prompt(1, vocab=256)
    parent_plan = planner(a).plan_save(ns, p, 48, Reason.COLD)
    first, _ = save(a, ns, p, 112, rng)  # a root at 112 tokens
    assert first.parent is None
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    path = a.path(ns, first.sha1)
    keep = os.path.join(a.root, "old-inode")
    os.link(path, keep)
    monkeypatch.setattr(a.scanner.journal, "append", lambda change: False)  # a gap
    monkeypatch.setattr(a.scanner.journal, "compact", lambda count, entries: False)
    a.remove_file(ns, first.sha1)
    parent, _ = save(a, ns, p, 48, rng)
    assert parent.sha1 == parent_plan.sha1
    again, _ = save(a, ns, p, 112, rng)
    assert again.sha1 == first.sha1 and again.parent == parent.sha1
    with open(keep, "r+b") as fh:  # the delta's bytes on the root's old inode
        fh.truncate(0)
        fh.write(open(path, "rb").read())
    os.rename(keep, path)
    caught_up(b)
    assert b.index.get(ns, first.sha1).parent == parent.sha1
    assert view(b) == truth(a.root)


# -- 6: nothing in the cache directory stops the engine -------------------------------


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lock_that_is_not_a_file_never_stops_a_start_or_a_save(tmp_path, kind):
    a, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    save(a, ns, prompt(1, vocab=256), 48, rng)
    os.unlink(os.path.join(a.root, NAME))
    lock = os.path.join(a.root, ".lock")
    os.unlink(lock)
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        os.mkdir(lock)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.start(background=False) is False  # scanned, not raised
    assert len(b.index) == 1
    with pytest.raises(SaveSkipped):
        save(b, ns, prompt(2, vocab=256), 48, rng)
    assert b.read_text(ns, next(iter(b.index.entries())).sha1)


# -- 7: a cache copied to another volume --------------------------------------------


def test_a_copied_cache_is_indexed_by_its_own_inodes(tmp_path):
    """A journal-started index of a copied cache kept the old inodes: hits were not
    recorded (``touch`` skips another file), partial lookups missed (``read_ids``)."""
    a, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    p = prompt(1, vocab=256)
    save(a, ns, p, 48, rng)
    delta, _ = save(a, ns, p, 112, rng)
    copy = str(tmp_path / "copy")
    shutil.copytree(a.root, copy)
    c = Store(copy, space_bytes=1 << 30)
    assert not c.scanner.start()  # the journal names the old volume's inodes: not used
    c.start(background=False)
    assert view(c) == truth(copy)
    entry = c.index.get(ns, delta.sha1)
    assert c.read_ids(entry, 0, 32) is not None
    c.touch(ns, delta.sha1)
    assert c.index.get(ns, delta.sha1).hits == 1


# -- 8: the quarantine keeps the newest evidence ------------------------------------


def test_the_quarantine_keeps_its_newest_evidence_under_distinct_names(tmp_path):
    """Trim went by the file's write time, which a rename keeps: an old file quarantined
    last went first. Two quarantines of one name in one second overwrote each other."""
    a, ns = make(tmp_path, clock=lambda: 1_000_000.0)
    rng = np.random.default_rng(0)
    p = prompt(1, vocab=256)
    first, _ = save(a, ns, p, 48, rng)
    a.quarantine(ns, first.sha1, "first")
    again, _ = save(a, ns, p, 48, rng)
    assert again.sha1 == first.sha1
    a.quarantine(ns, again.sha1, "second")
    names = a.quarantined_files()
    assert len(names) == 2
    qdir = os.path.join(a.root, DIRNAME)
    whys = sorted(open(os.path.join(qdir, n + ".why")).read().strip() for n in names)
    assert whys == ["first", "second"]
    # bounded to one file's bytes: an old file quarantined last is the one kept
    size = os.path.getsize(os.path.join(qdir, names[0]))
    b, ns_b = make(tmp_path / "b", quarantine_max_bytes=size, clock=lambda: 1_000_000.0)
    new, _ = save(b, ns_b, prompt(2, vocab=256), 48, rng)
    old, _ = save(b, ns_b, prompt(3, vocab=256), 48, rng)
    os.utime(b.path(ns_b, old.sha1), (1, 1))  # written long ago
    b.quarantine(ns_b, new.sha1, "newer file, quarantined first")
    b.quarantine(ns_b, old.sha1, "older file, quarantined last")
    (kept,) = b.quarantined_files()
    assert old.sha1 in kept


def test_the_parent_of_a_file_never_read_is_never_evicted(tmp_path, monkeypatch):
    """A delta unreadable since the start (its chain unknown): its parent looked like a
    leaf and went first. Nothing of its namespace is evicted until it is read."""
    store, a, b = two_namespaces(tmp_path)
    rng = np.random.default_rng(0)
    p = prompt(1, vocab=256)
    parent, _ = save(store, a, p, 48, rng)
    child, _ = save(store, a, p, 112, rng)
    real = scan_mod.read_indexable
    monkeypatch.setattr(
        scan_mod,
        "read_indexable",
        lambda fd, sha1: (
            (OSError(errno.EIO, "I/O error"), -1) if sha1 == child.sha1 else real(fd, sha1)
        ),
    )
    os.unlink(os.path.join(store.root, NAME))
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.start(background=False)  # a scan: the child never read
    on_disk = sum(os.path.getsize(store.path(a, e.sha1)) for e in (parent, child))
    fresh.space_bytes = on_disk + 15000
    for seed in range(2, 5):
        save(fresh, b, prompt(seed, vocab=256), 48, rng)
    assert os.path.exists(store.path(a, parent.sha1))
    assert on_disk_orphans(store.root) == []
    assert fresh.index.total_bytes + fresh.scanner.bad_bytes() <= fresh.space_bytes


def test_the_background_listing_reads_a_copied_cache_again(tmp_path):
    """Without the journal's directory check (a journal written before it, in the same
    directory inode), the first background listing compares identity and reads every
    file under its new inode again."""
    a, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    delta = None
    for length in (48, 112):
        delta, _ = save(a, ns, prompt(1, vocab=256), length, rng)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    for entry in list(b.index.entries()):  # the old volume's identities
        entry.inode += 1000
    b.scanner.reconcile()
    assert view(b) == truth(a.root)
    b.touch(ns, delta.sha1)
    assert b.index.get(ns, delta.sha1).hits == 1


def test_an_orphan_replaced_on_disk_while_judged_stays_known(tmp_path, monkeypatch):
    """``orphans(remove=True)`` deletes a file only if its name still is the file judged.
    One replaced meanwhile without the lock (by hand) stays on disk; its index entry used
    to go all the same, and a view following the journal never listed it again: a file on
    disk the index lacked for good."""
    store, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    p = prompt(5)
    root, _ = save(store, ns, p, 48, rng)
    child, _ = save(store, ns, p, 112, rng)
    assert child.parent == root.sha1
    os.unlink(store.path(ns, root.sha1))  # by hand: the child is an orphan
    real_catch_up = store.scanner.catch_up
    path = store.path(ns, child.sha1)

    def catch_up() -> None:  # under the lock, before the orphans are judged
        real_catch_up()
        shutil.copyfile(path, path + ".copy")
        os.replace(path + ".copy", path)  # the same bytes on another inode

    monkeypatch.setattr(store.scanner, "catch_up", catch_up)
    found = store.orphans(remove=True)
    monkeypatch.undo()
    assert [e.sha1 for e in found] == [child.sha1]
    assert os.path.exists(path)  # not the file that was judged: left alone
    store.refresh(ns)
    assert store.index.get(ns, child.sha1) is not None, "a file on disk the index lacks"
    assert [e.sha1 for e in store.orphans()] == [child.sha1]
