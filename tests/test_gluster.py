"""Two replicas on a real distributed file system: one GlusterFS volume mounted twice
through FUSE (two clients), a store on each mount, one cache directory. Each client keeps
its own page cache and attribute cache: what one writes, the other may read stale unless
the code asks the volume. No engine: the engine tests are in test_engine_gluster.py."""

import errno
import os
import threading
import time

import numpy as np
import pytest
from synth import FP, planner, prompt, save

from vllm_kvdisk.core.format import HEADER_FIELD_HITS
from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify

pytestmark = pytest.mark.gluster


@pytest.fixture
def replicas(gluster_mounts, request):
    """Store A on mount a, store B on mount b, one directory; A made the namespace."""
    a_root, b_root = (os.path.join(m, request.node.name) for m in gluster_mounts)

    def make(**kw):
        kw.setdefault("space_bytes", 1 << 30)
        a = Store(a_root, **kw)
        ns = a.ensure_namespace(FP)
        b = Store(b_root, **kw)
        b.scan()
        return a, b, ns

    make.roots = (a_root, b_root)
    return make


def on_disk(store: Store, ns: str) -> int:
    """Bytes of checkpoint files in the namespace, as the directory lists them now."""
    total = 0
    for de in os.scandir(store.ns_dir(ns)):
        if de.name.endswith(".kv"):
            total += de.stat(follow_symlinks=False).st_size
    return total


def test_a_removal_through_the_other_mount_is_seen_by_the_next_save(replicas):
    """The lock file counts every change of a name; a save lists the directory again only
    when the count moved. Each mount kept the lock file's bytes in its own page cache, so
    each read its own count: A never saw B's changes, its index kept B's deletions (and
    missed B's files) until an eviction listed everything."""
    a, b, ns = replicas()
    rng = np.random.default_rng(0)
    for i in range(5):
        theirs, _ = save(a, ns, prompt(100 + i), 48, rng)
        b.refresh(ns, force=True)
        b.remove_file(ns, theirs.sha1)
        added, _ = save(b, ns, prompt(200 + i), 48, rng)
        save(a, ns, prompt(300 + i), 48, rng)
        assert a.index.get(ns, theirs.sha1) is None, f"round {i}: A kept B's deletion"
        assert a.index.get(ns, added.sha1) is not None, f"round {i}: A missed B's file"


def test_two_mounts_keep_one_budget(replicas):
    """Saves alternate between the mounts at a budget of four and a half files: what is on
    disk never exceeds it (1.33 and 1.56 of it in two runs while each mount read its own
    count)."""
    a, b, ns = replicas()
    rng = np.random.default_rng(0)
    first, _ = save(a, ns, prompt(0), 48, rng)
    size = a.index.get(ns, first.sha1).size
    a.remove_file(ns, first.sha1)
    a.space_bytes = b.space_bytes = budget = 4 * size + size // 2
    peak = 0
    for i in range(24):
        save((a, b)[i % 2], ns, prompt(1 + i), 48, rng)
        peak = max(peak, on_disk(a, ns))
    assert peak <= budget, f"{peak} bytes on disk, budget {budget}"
    fresh = Store(a.root, space_bytes=budget)
    fresh.scan()
    assert verify(fresh).ok and fresh.index.total_bytes <= budget


def test_a_parent_removed_through_the_other_mount_is_never_built_on(replicas):
    """A saves a child of P right after B deleted P: the save is skipped (parent_gone),
    never an orphan, though A's index (and A's attribute cache) still had P."""
    a, b, ns = replicas()
    rng = np.random.default_rng(0)
    for i in range(10):
        p = prompt(400 + i)
        parent, _ = save(a, ns, p, 48, rng)
        b.refresh(ns, force=True)
        b.remove_file(ns, parent.sha1)
        with pytest.raises(SaveSkipped, match="parent_gone"):
            save(a, ns, p, 112, rng)
    fresh = Store(a.root, space_bytes=1 << 30)
    fresh.scan()
    assert not fresh.index.orphans() and verify(fresh).ok


def test_hits_through_both_mounts_add_up(replicas):
    """A hit reads the count under the file's lock and writes it back; each mount's page
    cache kept the header as that mount last wrote it, so hits through two mounts
    overwrote each other (3 of 6 counted)."""
    a, b, ns = replicas()
    plan, _ = save(a, ns, prompt(8), 48, np.random.default_rng(0))
    b.refresh(ns)
    for _ in range(3):
        a.touch(ns, plan.sha1)
        b.touch(ns, plan.sha1)
    assert stored_hits(a.path(ns, plan.sha1)) == 6


def stored_hits(path: str) -> int:
    """The hit count in a file's header as the volume holds it (this client's cached pages
    of the header are dropped first: they may be a second old)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 4096, os.POSIX_FADV_DONTNEED)
        return int.from_bytes(os.pread(fd, 4, HEADER_FIELD_HITS), "little")
    finally:
        os.close(fd)


def test_a_file_saved_through_one_mount_is_restored_through_the_other(replicas):
    """B finds A's new file at a refresh (its directory's mtime moves on B's mount within
    the attribute cache's second) and reads the same stored ids."""
    a, b, ns = replicas()
    rng = np.random.default_rng(0)
    p = prompt(9)
    root, _ = save(a, ns, p, 48, rng)
    child, _ = save(a, ns, p, 112, rng)
    deadline = time.monotonic() + 10
    while b.index.get(ns, child.sha1) is None and time.monotonic() < deadline:
        b.refresh(ns)
        time.sleep(0.05)
    found = planner(b).lookup(ns, p.ids, 112)
    assert [e.sha1 for e in found.chain] == [root.sha1, child.sha1]
    entry = b.index.get(ns, child.sha1)
    assert np.array_equal(b.read_ids(entry, 0, 112), p.ids[:112])


def test_verify_through_one_mount_while_the_other_saves_and_evicts(replicas):
    """kvdisk verify beside a live replica on another client: files evicted during its
    checksum pass are no problem, and orphans are judged from the directory as it is."""
    a, b, ns = replicas()
    rng = np.random.default_rng(0)
    first, _ = save(a, ns, prompt(0), 48, rng)
    size = a.index.get(ns, first.sha1).size
    a.space_bytes = 3 * size
    for i in range(3):
        save(a, ns, prompt(500 + i), 48, rng)
    stop, errors = threading.Event(), []

    def churn() -> None:
        i = 0
        try:
            while not stop.is_set():
                p = prompt(600 + i)
                for length in (48, 112):  # a root and its child: chains come and go
                    try:
                        save(a, ns, p, length, rng)
                    except SaveSkipped:
                        pass
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        reports = [verify(Store(b.root, space_bytes=1 << 30)) for _ in range(5)]
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert all(r.ok for r in reports), [r.problems for r in reports if not r.ok]


def test_a_file_another_client_deleted_leaves_the_listing_view(replicas):
    """A deletes a chain through its mount; B's client still answers a stat of the names
    (and an open, and a read of cached pages) for its attribute timeout. B's listing no
    longer shows them, but an entry the listing missed was kept when a stat said it was
    still the same file: a ghost in B's index (``kvdisk verify`` called a ghost whose
    parent had left an orphan, and its eviction plans counted bytes that were gone).
    Such an entry is asked of the volume now."""
    a, b, ns = replicas()
    rng = np.random.default_rng(0)
    p = prompt(7)
    parent, _ = save(a, ns, p, 48, rng)
    child, _ = save(a, ns, p, 112, rng)
    b.refresh(ns, force=True)
    for e in (parent, child):  # B's client caches their attributes and first pages
        with open(b.path(ns, e.sha1), "rb") as fh:
            fh.read(4096)
    a.remove_file(ns, child.sha1)
    a.remove_file(ns, parent.sha1)
    b.scanner.reconcile()
    assert b.index.get(ns, child.sha1) is None, "a file deleted through mount a"
    assert b.index.get(ns, parent.sha1) is None, "a file deleted through mount a"
    assert not b.index.orphans()


def test_a_namespace_removed_and_made_again_through_the_other_mount_takes_saves(replicas):
    """reset_cache (or kvdisk rm) through one client renames the namespace away and deletes
    it, and that client's next save makes it again. The other client's descriptor of the
    old directory then answers ESTALE to fstat (a local disk answers): its saves failed
    with "Stale file handle" until a restart. They may fail for the second its attribute
    cache still shows the old directory; then they land in the new one."""
    a, b, ns = replicas()
    rng = np.random.default_rng(0)
    save(a, ns, prompt(1), 48, rng)
    b.refresh(ns)
    assert b.remove_namespace(ns) == 1
    theirs, _ = save(b, ns, prompt(2), 48, rng)
    failures, landed = [], None
    deadline = time.monotonic() + 15
    while landed is None and time.monotonic() < deadline:
        try:
            landed, _ = save(a, ns, prompt(3 + len(failures)), 48, rng)
        except (OSError, SaveSkipped) as exc:
            failures.append(exc)
            time.sleep(0.1)
    assert landed is not None, f"{len(failures)} saves failed: {failures[-1]}"
    assert all(
        getattr(f, "errno", None) == errno.ESTALE or getattr(f, "reason", "") == "namespace_removed"
        for f in failures
    ), failures
    fresh = Store(b.root, space_bytes=1 << 30)
    fresh.scan()
    assert sorted(e.sha1 for e in fresh.index.entries()) == sorted([theirs.sha1, landed.sha1])


def test_a_replica_starts_from_the_journal_the_other_mount_wrote(replicas):
    """A start reads the journal, not every file's header (83 s for 100k files on this
    volume); what A saves and removes through its mount reaches B through the journal's
    lines, read past B's client caches, and B's index stays the directory's, with no
    listing; B's evicting save stats its victims through its own mount."""
    a, _, ns = replicas()
    rng = np.random.default_rng(5)
    saved = [save(a, ns, prompt(500 + i), 48, rng)[0] for i in range(4)]
    b = Store(replicas.roots[1], space_bytes=1 << 30)
    assert b.scanner.start() and len(b.index) == 4
    for round_ in range(3):
        added, _ = save(a, ns, prompt(600 + round_), 48, rng)
        a.remove_file(ns, saved[round_].sha1)
        b.refresh(ns)
        assert b.index.get(ns, added.sha1) is not None, f"round {round_}: B missed A's file"
        assert b.index.get(ns, saved[round_].sha1) is None, f"round {round_}: B kept it"
    b.space_bytes = b.index.total_bytes
    mine, _ = save(b, ns, prompt(700), 48, rng)
    assert b.stats.evicted == 1 and b.index.get(ns, mine.sha1) is not None
    assert on_disk(b, ns) == b.index.total_bytes <= b.space_bytes
    a.refresh(ns)
    assert {e.sha1 for e in a.index.entries()} == {e.sha1 for e in b.index.entries()}
    assert verify(a).ok
