"""Several replicas on one directory: races between two stores, made deterministic by
calling them in a chosen order or by an Event barrier (never by timing)."""

import os
import threading

import numpy as np
import pytest
from synth import FP, encode, pages, planner, prompt, prompt_of, save

from vllm_kvdisk.core.format import HEADER_FIELD_HITS, Reason
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage import verify as verify_module
from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.directory import Directory
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify


def replicas(tmp_path, **kw):
    kw.setdefault("space_bytes", 1 << 30)
    a = Store(str(tmp_path / "cache"), **kw)
    ns = a.ensure_namespace(FP)
    b = Store(a.root, **kw)
    b.scan()
    return a, b, ns


def test_a_name_on_disk_is_never_replaced_by_other_content(tmp_path):
    """Token 256 is "ab": 48 of them render the same text as 96 ids of "a", "b", so both
    saves have one name. Replica B's save used to rename over replica A's file, and A's
    child then hung under a parent of other ids: an orphan nothing could load."""
    a, b, ns = replicas(tmp_path)
    rng = np.random.default_rng(0)
    pa = prompt_of(np.array([256] * 48 + [97] * 64))
    pb = prompt_of(np.array([97, 98] * 48))
    root, _ = save(a, ns, pa, 48, rng)
    child, _ = save(a, ns, pa, 112, rng)
    b.refresh(ns)
    plan = planner(b).plan_save(ns, pb, 96, Reason.COLD)
    assert plan is not None and plan.sha1 == root.sha1 and plan.parent is None
    inode = os.stat(a.path(ns, root.sha1)).st_ino
    with pytest.raises(SaveSkipped, match="exists"):
        b.write(ns, plan.sha1, encode(plan, pb, pages(rng, plan)))
    assert os.stat(a.path(ns, root.sha1)).st_ino == inode
    fresh = Store(a.root, space_bytes=1 << 30)
    fresh.scan()
    assert [e.sha1 for e in planner(fresh).lookup(ns, pa.ids, 112).chain] == [root.sha1, child.sha1]
    assert not fresh.index.orphans() and verify(fresh).ok


def test_a_reused_inode_is_not_mistaken_for_the_file_it_held(tmp_path):
    """ext4 hands a freed inode to the next file at once. Replica B evicts X and saves it
    again as a delta on a new parent Q; the new X got X's old inode. Replica A's entry
    (no parent, the old size) used to survive even a forced refresh, and A's eviction then
    deleted Q under X: an orphan, and a budget counted with the wrong size."""
    a, b, ns = replicas(tmp_path)
    rng = np.random.default_rng(0)
    p = prompt(3, vocab=256)
    x, _ = save(a, ns, p, 48, rng)
    b.refresh(ns)
    b.remove_file(ns, x.sha1)  # B evicts X ...
    q, _ = save(b, ns, p, 32, rng)  # ... and saves a shorter prefix, then X on it
    x2, _ = save(b, ns, p, 48, rng)
    assert x2.sha1 == x.sha1 and x2.parent == q.sha1
    # The inode reuse, made certain: A's stale entry carries the new file's inode.
    a.index.get(ns, x.sha1).inode = os.stat(a.path(ns, x.sha1)).st_ino
    a.refresh(ns, force=True)
    seen = a.index.get(ns, x.sha1)
    assert seen.parent == q.sha1 and seen.size == os.stat(a.path(ns, x.sha1)).st_size
    assert [e.sha1 for e in a.evict(1)] == [x.sha1]  # the leaf goes, never Q under it
    assert not a.index.orphans() and verify(a).ok


def test_verify_fix_decides_orphans_from_the_directory_as_it_is_at_the_end(tmp_path, monkeypatch):
    """A long checksum pass runs outside the lock. A parent another replica saves again
    meanwhile makes its children sound again; verify --fix used to delete them (and their
    own children) from the scan it took before the pass. A file another replica evicts
    during the pass is gone, not "unreadable": verify used to fail on a live cache."""
    a, b, ns = replicas(tmp_path)
    rng = np.random.default_rng(0)
    p = prompt(4, vocab=256)
    root, _ = save(a, ns, p, 48, rng)
    child, _ = save(a, ns, p, 112, rng)
    grandchild, _ = save(a, ns, p, 176, rng)
    leaf, _ = save(a, ns, prompt(5, vocab=256), 48, rng)
    os.unlink(a.path(ns, root.sha1))  # a crash left the children without their parent
    b.scan()
    real = verify_module.check_file
    done = []

    def check_file(store, ns_, sha1, on_bad=None):
        if not done:  # meanwhile another replica saves the parent again, evicts a leaf
            done.append(True)
            save(b, ns, p, 48, rng)
            b.remove_file(ns, leaf.sha1)
        return real(store, ns_, sha1, on_bad)

    monkeypatch.setattr(verify_module, "check_file", check_file)
    fixer = Store(a.root, space_bytes=1 << 30)
    report = verify(fixer)
    assert report.ok, report.problems
    for plan in (root, child, grandchild):
        assert os.path.exists(a.path(ns, plan.sha1))
    assert not os.path.exists(a.path(ns, leaf.sha1))


def test_a_file_another_replica_hit_is_not_evicted_as_cold(tmp_path):
    """Headers of known files were never read again: replica A evicted the file replica B
    had hit 20 times (its view said 0 hits, and it was older) instead of a cold one."""
    now = [1000.0]
    a, b, ns = replicas(tmp_path, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    hot, _ = save(a, ns, prompt(6, vocab=256), 48, rng, now=1000)
    now[0] = 1001
    cold, _ = save(a, ns, prompt(7, vocab=256), 48, rng, now=1001)
    b.refresh(ns)
    for _ in range(20):
        b.touch(ns, hot.sha1)
    assert [e.sha1 for e in a.evict(1)] == [cold.sha1]
    assert os.path.exists(a.path(ns, hot.sha1))


def test_hits_of_two_replicas_on_one_file_add_up(tmp_path, monkeypatch):
    """touch() reads the hit count and writes it back: two replicas hitting one file at
    once both read 0 and both wrote 1. The barrier places B's whole hit between A's read
    and A's write; a hit now holds the file's lock, so B waits for A instead."""
    a, b, ns = replicas(tmp_path)
    plan, _ = save(a, ns, prompt(8, vocab=256), 48, np.random.default_rng(0))
    b.refresh(ns)
    a_read, b_waits = threading.Event(), threading.Event()
    real_pread, real_flock = os.pread, fsdir.fcntl.flock

    def pread(fd, n, offset):
        out = real_pread(fd, n, offset)
        if threading.current_thread().name == "A" and offset == HEADER_FIELD_HITS:
            a_read.set()
            b_waits.wait()
        return out

    def flock(fd, op):
        if threading.current_thread().name == "MainThread" and op == fsdir.fcntl.LOCK_EX:
            try:
                return real_flock(fd, op | fsdir.fcntl.LOCK_NB)
            except BlockingIOError:
                b_waits.set()  # B holds off until A has written
        return real_flock(fd, op)

    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(fsdir.fcntl, "flock", flock)
    hit_a = threading.Thread(target=a.touch, args=(ns, plan.sha1), name="A")
    hit_a.start()
    a_read.wait()
    b.touch(ns, plan.sha1)
    b_waits.set()
    hit_a.join()
    monkeypatch.undo()
    fresh = Store(a.root, space_bytes=1 << 30)
    fresh.scan()
    assert fresh.index.get(ns, plan.sha1).hits == 2


def test_remove_namespace_deletes_its_files_outside_the_lock(tmp_path, monkeypatch):
    """Deleting 100k files took minutes, and under ROOT/.lock every other replica's saves
    timed out meanwhile. The directory is renamed away under the lock; the files go after."""
    a, b, ns = replicas(tmp_path)
    rng = np.random.default_rng(0)
    for seed in range(3):
        save(a, ns, prompt(seed, vocab=256), 48, rng)
    real = Directory.delete_tree
    lock_free = []

    def delete_tree(self, name, **kwargs):
        with b.dir_lock(timeout_s=0):  # LockTimeout while the remover holds it
            lock_free.append(name)
        return real(self, name, **kwargs)

    monkeypatch.setattr(Directory, "delete_tree", delete_tree)
    assert a.remove_namespace(ns) == 3
    assert lock_free
    assert [
        n for n in os.listdir(a.root) if n not in (".lock", ".journal", ".salt-key", ".clock")
    ] == []


def test_trash_left_by_a_killed_remover_goes_at_the_next_scan(tmp_path):
    """A kill -9 between a namespace's rename and its deletion, a directory someone made
    inside it, or a writer's temp file left the renamed directory for good, hidden from
    ls, stats and verify, and counting against the free-space watermark."""
    a, b, ns = replicas(tmp_path)
    save(a, ns, prompt(1, vocab=256), 48, np.random.default_rng(0))
    trash = os.path.join(a.root, f".trash-{ns}-123-456")
    os.rename(a.ns_dir(ns), trash)  # the remover was killed here
    os.makedirs(os.path.join(trash, "made", "inside"))
    with open(os.path.join(trash, "made", "inside", "x"), "wb") as fh:
        fh.write(b"x")
    with open(os.path.join(trash, ".tmp-abc.kv-1-ff"), "wb") as fh:
        fh.write(b"partial")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k")
    os.symlink(outside, os.path.join(trash, "link"))
    ro = Store(a.root, space_bytes=1 << 30, readonly=True)
    ro.scan()
    assert os.path.exists(trash)  # a read-only store changes nothing
    b.scan()
    assert not os.path.exists(trash)
    assert (outside / "keep").exists()  # never followed through a symlink


def test_a_save_lists_the_namespace_only_when_the_journal_cannot_say_what_changed(
    tmp_path, monkeypatch
):
    """A save's own temp file moved the directory's mtime, so every save re-listed its
    namespace under the lock (727 ms at 100k files, serialised across replicas; seconds
    on a network file system). Names change only under the lock, the lock file counts the
    changes and the journal says what each was: a save reads the other replica's lines
    and lists nothing; only a change without its line (a writer killed between the count
    and the line) makes it list."""
    a, b, ns = replicas(tmp_path)
    rng = np.random.default_rng(0)
    save(a, ns, prompt(0, vocab=256), 48, rng)
    real = os.scandir
    listed = []

    def scandir(path=None):
        if isinstance(path, int) and path == a.directory.namespace(ns).fd:
            listed.append(path)
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    for seed in (1, 2, 3):
        save(a, ns, prompt(seed, vocab=256), 48, rng)
    assert listed == []
    b.refresh(ns)
    theirs, _ = save(b, ns, prompt(4, vocab=256), 48, rng)
    b.remove_file(ns, theirs.sha1)
    again, _ = save(b, ns, prompt(5, vocab=256), 48, rng)
    save(a, ns, prompt(6, vocab=256), 48, rng)
    assert listed == []  # another replica's changes: read from the journal
    assert a.index.get(ns, again.sha1) is not None and a.index.get(ns, theirs.sha1) is None
    fresh = Store(a.root, space_bytes=1 << 30)
    fresh.scan()
    assert a.index.total_bytes == fresh.index.total_bytes and len(a.index) == 6
    # B dies between counting a change and journaling it: A cannot chain, so it lists.
    monkeypatch.setattr(b.scanner.journal, "append", lambda change: False)
    monkeypatch.setattr(b.scanner.journal, "compact", lambda count, entries: False)
    b.refresh(ns)
    unjournaled, _ = save(b, ns, prompt(7, vocab=256), 48, rng)
    save(a, ns, prompt(8, vocab=256), 48, rng)
    assert len(listed) == 1
    assert a.index.get(ns, unjournaled.sha1) is not None and len(a.index) == 8


def test_a_name_landing_while_a_save_writes_is_not_replaced(tmp_path, monkeypatch):
    """The same race with the other file landing while this save writes its temp file:
    only the check under the lock, just before the rename, can see it."""
    a, b, ns = replicas(tmp_path)
    rng = np.random.default_rng(0)
    pa = prompt_of(np.array([256] * 48 + [97] * 64))
    pb = prompt_of(np.array([97, 98] * 48))
    plan = planner(b).plan_save(ns, pb, 96, Reason.COLD)
    write = fsdir.TempFile.write
    landed, started = [], []

    def meanwhile(self, buffers):
        written = write(self, buffers)
        if not started:  # replica A lands the name (and a child on it) meanwhile
            started.append(True)
            landed.append(save(a, ns, pa, 48, rng)[0])
            landed.append(save(a, ns, pa, 112, rng)[0])
        return written

    monkeypatch.setattr(fsdir.TempFile, "write", meanwhile)
    with pytest.raises(SaveSkipped, match="exists"):
        b.write(ns, plan.sha1, encode(plan, pb, pages(rng, plan)))
    assert landed[0].sha1 == plan.sha1
    fresh = Store(a.root, space_bytes=1 << 30)
    fresh.scan()
    assert [e.sha1 for e in planner(fresh).lookup(ns, pa.ids, 112).chain] == [
        s.sha1 for s in landed
    ]


def test_a_hard_linked_lock_file_is_never_written(tmp_path):
    """The lock file now holds a change count; someone else's file hard-linked as
    ``.lock`` must not get those bytes (and its count is then never trusted)."""
    a, b, ns = replicas(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.link(victim, os.path.join(a.root, ".lock"))
    rng = np.random.default_rng(0)
    save(a, ns, prompt(1, vocab=256), 48, rng)
    theirs, _ = save(b, ns, prompt(2, vocab=256), 48, rng)
    save(a, ns, prompt(3, vocab=256), 48, rng)
    assert victim.read_bytes() == b"precious"
    assert a.index.get(ns, theirs.sha1) is not None


def test_reset_cache_leaves_the_deletion_to_a_thread(tmp_path, monkeypatch):
    """reset_cache runs inside the engine's step: the namespace is renamed away at once
    (no lookup or save finds it), its files go in a thread of their own."""
    import shutil

    a, b, ns = replicas(tmp_path)
    rng = np.random.default_rng(0)
    for seed in range(3):
        save(a, ns, prompt(seed, vocab=256), 48, rng)
    started, gate = threading.Event(), threading.Event()
    real = shutil.rmtree

    def rmtree(*args, **kwargs):
        started.set()
        gate.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert a.remove_namespace(ns, wait=False) == 3  # returned while the deletion waits
    started.wait()
    assert not os.path.exists(a.ns_dir(ns))
    b.refresh(ns)
    assert len(b.index) == 0
    gate.set()
    for thread in a.removing:
        thread.join()
    assert [
        n for n in os.listdir(a.root) if n not in (".lock", ".journal", ".salt-key", ".clock")
    ] == []
