"""The journal of name changes (``ROOT/.journal``): a start from one file instead of every
file's header, other replicas' changes read from its lines instead of a listing, evictions
that stat their victims only, and a journal that cannot be trusted never used."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import weakref

import numpy as np
import pytest

from tests.synth import FP, make, prompt, save
from vllm_kvdisk.core.changes import JournalError, row_entry
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage import scan as scan_mod
from vllm_kvdisk.storage import startup as startup_mod
from vllm_kvdisk.storage.directory import NS_NAME
from vllm_kvdisk.storage.journal import NAME
from vllm_kvdisk.storage.store import Store


def view(store: Store) -> set[tuple]:
    return {
        (
            e.ns,
            e.sha1,
            e.tokens,
            e.parent,
            e.parent_tokens,
            e.size,
            e.inode,
            e.mtime_ns,
            e.token_digest,
            e.head,
            e.ids_at,
        )
        for e in store.index.entries()
    }


def truth(root: str) -> set[tuple]:
    """The index a full scan of the directory builds."""
    fresh = Store(root, space_bytes=1 << 30)
    fresh.scan()
    return view(fresh)


def filled(tmp_path, files: int = 6) -> tuple[Store, str]:
    store, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    for seed in range(files):
        p = prompt(seed, vocab=256)
        save(store, ns, p, 48, rng)
        save(store, ns, p, 96, rng)  # a delta on it
    return store, ns


class Counted:
    """Counts the checkpoint headers read and the namespace directories listed (the root,
    which holds only namespaces, is not counted)."""

    def __init__(self, monkeypatch):
        self.read, self.listed = [], []
        real_read, real_scandir = scan_mod.read_indexable, os.scandir

        def scandir(path=None):
            if isinstance(path, int) and NS_NAME.match(
                os.path.basename(os.readlink(f"/proc/self/fd/{path}"))
            ):
                self.listed.append(path)
            return real_scandir(path)

        monkeypatch.setattr(
            scan_mod,
            "read_indexable",
            lambda fd, sha1: (self.read.append(sha1), real_read(fd, sha1))[1],
        )
        monkeypatch.setattr(os, "scandir", scandir)


def test_a_start_reads_the_journal_not_every_file(tmp_path, monkeypatch):
    """A start-up scan read every file's header: 83 s for 100k files on GlusterFS. A
    start from the journal reads one file and builds the same index."""
    a, ns = filled(tmp_path)
    assert os.path.isfile(os.path.join(a.root, NAME))
    want = truth(a.root)
    counted = Counted(monkeypatch)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    assert counted.read == [] and counted.listed == []
    assert view(b) == want and len(want) == 12


def test_what_the_journal_missed_is_found_by_the_listing_after_a_start(tmp_path, monkeypatch):
    """A writer killed between its rename and its line leaves a file the journal does not
    name; a file deleted by hand leaves a line naming a file that is gone. The listing
    that follows a start (in the background in an engine) settles both."""
    a, ns = filled(tmp_path, files=2)
    monkeypatch.setattr(a.scanner.journal, "append", lambda change: False)
    monkeypatch.setattr(a.scanner.journal, "compact", lambda count, entries: False)
    rng = np.random.default_rng(1)
    unjournaled, _ = save(a, ns, prompt(9, vocab=256), 48, rng)
    gone = next(e for e in a.index.entries() if e.parent is not None)
    os.unlink(a.path(ns, gone.sha1))
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    assert b.index.get(ns, unjournaled.sha1) is None and b.index.get(ns, gone.sha1)
    b.scanner.reconcile()
    assert b.index.get(ns, unjournaled.sha1) is not None and b.index.get(ns, gone.sha1) is None
    assert view(b) == truth(a.root)


@pytest.mark.parametrize(
    "damage", ["garbage", "torn snapshot", "foreign version", "fifo", "symlink", "bad entry", "gap"]
)
def test_a_journal_that_cannot_be_trusted_is_not_used(tmp_path, damage):
    """Torn, foreign or hostile: the start scans the directory instead (never a hang on a
    FIFO, never a symlink followed, never an entry of a bad shape), and the index is the
    directory's."""
    a, ns = filled(tmp_path, files=2)
    path = os.path.join(a.root, NAME)
    raw = open(path, "rb").read()
    lines = raw.split(b"\n")
    os.unlink(path)
    if damage == "garbage":
        open(path, "wb").write(b"\x00\xff" * 100)
    elif damage == "torn snapshot":
        open(path, "wb").write(raw[: len(lines[0]) + 40])
    elif damage == "foreign version":
        open(path, "wb").write(raw.replace(b'"kvdisk_journal":2', b'"kvdisk_journal":9', 1))
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "symlink":
        os.symlink(str(tmp_path / "elsewhere"), path)
        (tmp_path / "elsewhere").write_bytes(raw)
    elif damage == "bad entry":
        open(path, "wb").write(raw.replace(b'"' + lines[1][2:18] + b'"', b'"../../etc"', 1))
    elif damage == "gap":  # a change line missing: its writer died after counting it
        kept = [line for i, line in enumerate(lines) if i != len(lines) - 3]
        open(path, "wb").write(b"\n".join(kept))
    b = Store(a.root, space_bytes=1 << 30)
    assert not b.scanner.start() and len(b.index) == 0
    assert b.start(background=False) is False  # scanned
    assert view(b) == truth(a.root) and len(b.index) == 4


def test_another_replica_follows_the_journal_through_a_rewrite(tmp_path, monkeypatch):
    """The journal's snapshot is rewritten when its lines outgrow it; a replica that read
    the old file follows into the new one and its index stays the directory's, without a
    listing."""
    monkeypatch.setattr(scan_mod, "COMPACT_LINES", 3)
    a, ns = filled(tmp_path, files=1)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    counted = Counted(monkeypatch)
    rng = np.random.default_rng(2)
    inode = os.stat(os.path.join(a.root, NAME)).st_ino
    for seed in range(10, 20):
        save(a, ns, prompt(seed, vocab=256), 48, rng)
    a.remove_file(ns, next(iter(a.index.entries())).sha1)
    assert os.stat(os.path.join(a.root, NAME)).st_ino != inode  # rewritten
    b.refresh(ns)  # what the scheduler does every 2 s
    assert counted.listed == [] and counted.read == []
    assert view(b) == view(a) == truth(a.root)


def test_an_eviction_stats_its_victims_and_lists_nothing(tmp_path, monkeypatch):
    """Every eviction listed and stat'ed the whole namespace under the lock (43 s per
    evicting save at 100k files on GlusterFS). It now decides from the index the journal
    keeps current and stats only the files it deletes."""
    a, ns = filled(tmp_path)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    counted = Counted(monkeypatch)
    stats = []
    real_stat = os.stat

    def stat(name, *args, **kw):
        if str(name).endswith(".kv"):
            stats.append(name)
        return real_stat(name, *args, **kw)

    monkeypatch.setattr(os, "stat", stat)
    b.space_bytes = b.index.total_bytes  # full: the next save evicts
    new, _ = save(b, ns, prompt(50, vocab=256), 48, np.random.default_rng(3))
    assert b.index.get(ns, new.sha1) is not None and b.stats.evicted >= 1
    assert counted.listed == [] and counted.read == []
    assert len(stats) <= 2 * b.stats.evicted + 4  # victims, the new name, the parent
    assert view(b) == truth(a.root) and b.index.total_bytes <= b.space_bytes


def test_a_victim_another_replica_hit_is_read_again_before_it_goes(tmp_path):
    """Without listings, another replica's hits reach this index only through the stat of
    a victim: its header is read again and the plan made again, so the cold file goes."""
    now = [1000.0]
    a, ns = make(tmp_path, clock=lambda: now[0])
    rng = np.random.default_rng(4)
    hot, _ = save(a, ns, prompt(1, vocab=256), 48, rng, now=1000)
    now[0] = 1001
    cold, _ = save(a, ns, prompt(2, vocab=256), 48, rng, now=1001)
    b = Store(a.root, space_bytes=1 << 30, clock=lambda: now[0])
    assert b.scanner.start()
    for _ in range(20):
        a.touch(ns, hot.sha1)
    b.space_bytes = b.index.total_bytes
    save(b, ns, prompt(3, vocab=256), 48, rng)
    assert b.index.get(ns, hot.sha1) is not None and b.index.get(ns, cold.sha1) is None
    assert b.index.get(ns, hot.sha1).hits == 20


def test_a_replica_that_meets_a_gap_lists_then_follows_the_next_snapshot(tmp_path, monkeypatch):
    """A change line that never came (its writer died after counting it): the reader that
    finds the next line cannot chain to it, lists instead of guessing, and follows the
    journal again once a whole store rewrote the snapshot."""
    a, ns = filled(tmp_path, files=1)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    rng = np.random.default_rng(6)
    real_append = a.scanner.journal.append
    monkeypatch.setattr(a.scanner.journal, "append", lambda change: False)
    monkeypatch.setattr(a.scanner.journal, "compact", lambda count, entries: False)
    lost, _ = save(a, ns, prompt(30, vocab=256), 48, rng)
    monkeypatch.setattr(a.scanner.journal, "append", real_append)
    after, _ = save(a, ns, prompt(31, vocab=256), 48, rng)
    b.refresh(ns)
    assert not b.scanner.journaled()  # the gap: this refresh listed
    assert b.index.get(ns, lost.sha1) is not None and b.index.get(ns, after.sha1) is not None
    monkeypatch.undo()
    a.remove_file(ns, lost.sha1)
    assert a.scanner.write_snapshot(1.0)  # what a whole store does when lines pile up
    b.refresh(ns)
    assert b.scanner.journaled() and b.index.get(ns, lost.sha1) is None
    assert view(b) == truth(a.root)


def test_a_cache_that_never_counted_gets_a_journal_at_its_first_start(tmp_path):
    """Files written by an older kvdisk (no count in the lock file, no journal): the first
    start scans them and writes the snapshot, and the next start reads it."""
    a, ns = filled(tmp_path, files=2)
    os.unlink(os.path.join(a.root, NAME))
    os.truncate(os.path.join(a.root, ".lock"), 0)
    first = Store(a.root, space_bytes=1 << 30)
    assert first.start(background=False) is False  # scanned
    second = Store(a.root, space_bytes=1 << 30)
    assert second.scanner.start() and view(second) == truth(a.root)


def test_a_quarantine_during_a_listing_never_writes_a_partial_snapshot(tmp_path):
    """A listing under the lock (after a gap) quarantines a corrupt file of the namespace
    it lists first; the quarantine journals a change, and the view was called whole
    before the listing ended: the snapshot written then missed the other namespace's
    files, and every store starting from it lost them for good."""
    a, first = make(tmp_path)
    second = a.ensure_namespace(dataclasses.replace(FP, model="other"))
    first, second = sorted([first, second])
    rng = np.random.default_rng(0)
    save(a, first, prompt(0, vocab=256), 48, rng)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    theirs, _ = save(b, second, prompt(1, vocab=256), 48, rng)
    with open(os.path.join(a.root, ".lock"), "r+b") as fh:  # a writer killed before its line
        count = int.from_bytes(fh.read(8), "little")
        fh.seek(0)
        fh.write((count + 1).to_bytes(8, "little"))
    with open(os.path.join(a.root, first, "ab" * 20 + ".kv"), "wb") as fh:
        fh.write(b"garbage" * 100)
    os.unlink(os.path.join(a.root, NAME))  # the next change rewrites the snapshot
    with a.lock.hold(), a._mutex:
        a.scanner.catch_up()
    assert a.stats.quarantined == 1 and a.index.get(second, theirs.sha1) is not None
    fresh = Store(a.root, space_bytes=1 << 30)
    assert not fresh.scanner.start()  # no snapshot of a half-listed view was written
    save(a, first, prompt(2, vocab=256), 48, rng)  # a whole view writes one
    fresh = Store(a.root, space_bytes=1 << 30)
    assert fresh.scanner.start() and fresh.index.get(second, theirs.sha1) is not None
    assert view(fresh) == truth(a.root)


def test_a_removed_namespace_is_never_in_a_snapshot(tmp_path):
    """remove_namespace journaled its removal while its entries were still indexed: a
    snapshot written then named every file of it, and stores starting from it counted
    them against the budget for good (the listing after a start skips gone namespaces)."""
    a, ns = filled(tmp_path, files=2)
    os.unlink(os.path.join(a.root, NAME))  # the next change rewrites the snapshot
    assert a.remove_namespace(ns) == 4
    b = Store(a.root, space_bytes=1 << 30)
    assert b.start(background=False) is not None
    assert len(b.index) == 0 and b.index.total_bytes == 0


def test_a_rename_that_raised_after_it_happened_is_still_seen(tmp_path, monkeypatch):
    """The directory's fsync after a rename can fail (EIO) with the name in place, and an
    NFS rename retried after a lost reply fails although it happened: the file was on
    disk, counted by nobody, so no replica ever saw it (its key could not be saved again,
    its children were refused as parent_gone)."""
    a, ns = filled(tmp_path, files=1)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.scanner.start()
    rng = np.random.default_rng(7)
    real = fsdir.TempFile.commit

    def commit(self):
        os.replace(self.name, self.final, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        self.committed = True
        raise OSError(5, "EIO on the directory's fsync")

    monkeypatch.setattr(fsdir.TempFile, "commit", commit)
    with pytest.raises(OSError):
        save(a, ns, prompt(40, vocab=256), 48, rng)
    monkeypatch.setattr(fsdir.TempFile, "commit", real)
    save(a, ns, prompt(41, vocab=256), 48, rng)
    b.refresh(ns)
    assert view(a) == view(b) == truth(a.root) and len(a.index) == 4


def test_a_hostile_reason_is_a_bad_journal_not_a_crash():
    """A list where the reason goes raised TypeError (unhashable) out of the journal's
    reader, and the engine did not start."""
    row = ["a" * 16, "b" * 40, 32, None, 0, [1], 0, 0, 0, 1, 1, 1, 1, 1, 1]
    with pytest.raises(JournalError):
        row_entry(row)


def test_a_running_store_lists_the_directory_again_in_the_background(tmp_path, monkeypatch):
    """Without listings at saves, a temp file of a writer killed mid-save and a file no
    journal line names stayed until the next start. An engine's store lists the
    directory in a thread of its own: at once after a start from the journal, then every
    RECONCILE_EVERY_S."""
    monkeypatch.setattr(startup_mod, "RECONCILE_EVERY_S", 0.05)
    a, ns = filled(tmp_path, files=1)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.start() is True  # from the journal; the thread lists
    monkeypatch.setattr(a.scanner.journal, "append", lambda change: False)
    monkeypatch.setattr(a.scanner.journal, "compact", lambda count, entries: False)
    unjournaled, _ = save(a, ns, prompt(60, vocab=256), 48, np.random.default_rng(8))
    dead = os.path.join(a.root, ns, f".tmp-{'c' * 40}.kv-1-dead")
    with open(dead, "wb") as fh:
        fh.write(b"half a checkpoint")
    os.utime(dead, (1, 1))  # older than the grace a live writer gets
    deadline = time.monotonic() + 60  # a wait for the thread, not a measure of it
    while time.monotonic() < deadline and (
        b.index.get(ns, unjournaled.sha1) is None or os.path.exists(dead)
    ):
        time.sleep(0.05)
    assert b.index.get(ns, unjournaled.sha1) is not None and not os.path.exists(dead)
    b.close()


def test_the_listing_thread_never_keeps_a_dropped_store_alive(tmp_path, monkeypatch):
    """The thread held its store, and through the store's callbacks an engine's worker and
    KV cache: a test run of in-process engines ran out of memory (23 GB)."""
    monkeypatch.setattr(startup_mod, "RECONCILE_EVERY_S", 0.01)
    store, _ = make(tmp_path)
    store.start()
    dropped = weakref.ref(store)
    del store
    deadline = time.monotonic() + 60  # a wait for the thread's next turn, not a measure
    while dropped() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    assert dropped() is None
