"""The directory: atomic files, rebuild from headers, quarantine, one budget, processes."""

import contextlib
import multiprocessing as mp
import os
import stat
import time
from types import SimpleNamespace

import numpy as np
import pytest
from synth import BLOCK, FP, encode, make, planner, prompt, save

from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.fileread import read_layer_into
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify


def free_space(amount):
    """A statvfs stand-in reporting ``amount[0]`` bytes free."""
    return lambda fd: SimpleNamespace(f_bavail=amount[0] // 4096, f_frsize=4096)


def test_files_permissions_and_rebuild_from_headers(tmp_path):
    store, ns = make(tmp_path)
    p = prompt()
    rng = np.random.default_rng(0)
    written = {}
    for length in (48, 112, 240):
        plan, layers = save(store, ns, p, length, rng)
        written[plan.sha1] = (plan, layers)
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.ns_dir(ns)).st_mode) == 0o700
    for sha1 in written:
        assert stat.S_IMODE(os.stat(store.path(ns, sha1)).st_mode) == 0o600
        with open(store.path(ns, sha1), "rb") as fh:
            assert fh.read(3) == b"KVC"
    assert not [n for n in os.listdir(store.ns_dir(ns)) if n.startswith(".tmp-")]
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()
    assert len(fresh.index) == 3 and fresh.index.total_bytes == store.index.total_bytes
    hit = planner(fresh).lookup(ns, p.ids, 399)
    assert [e.tokens for e in hit.chain] == [48, 112, 240]
    for e in hit.chain:  # the chain's pages are exactly the pages written
        plan, layers = written[e.sha1]
        with fresh.open(ns, e.sha1) as (fd, meta, _):
            assert meta.payload.first_block * BLOCK == plan.parent_tokens
            for i, want in enumerate(layers):
                buf = bytearray(meta.offsets.layer_bytes)
                read_layer_into(fd, meta, i, memoryview(buf))
                assert bytes(buf) == want
    assert verify(fresh).ok


def test_hit_count_and_last_use_update_in_place(tmp_path):
    now = [1000.0]
    store, ns = make(tmp_path, clock=lambda: now[0])
    plan, _ = save(store, ns, prompt(), 48, np.random.default_rng(0), now=1000)
    now[0] = 5000
    store.touch(ns, plan.sha1)
    store.touch(ns, plan.sha1)
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()
    e = fresh.index.get(ns, plan.sha1)
    assert (e.hits, e.last_used, e.created) == (2, 5000, 1000)
    assert verify(fresh).ok  # header stats are outside the checksums by design


@pytest.mark.parametrize("damage", ["truncate", "flip_page", "garbage", "empty", "foreign_text"])
def test_bad_files_are_quarantined_and_never_indexed(tmp_path, damage):
    store, ns = make(tmp_path)
    p = prompt()
    rng = np.random.default_rng(0)
    good, _ = save(store, ns, p, 48, rng)
    bad, _ = save(store, ns, p, 112, rng)
    path = store.path(ns, bad.sha1)
    raw = bytearray(open(path, "rb").read())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip_page":
        raw[-100] ^= 0x40
    elif damage == "garbage":
        raw = bytearray(os.urandom(len(raw)))
    elif damage == "empty":
        raw = bytearray()
    else:
        raw[60] ^= 0x01  # the text no longer hashes to the file name
    open(path, "wb").write(bytes(raw))
    fresh = Store(store.root, space_bytes=1 << 30)
    report = verify(fresh)  # a writable store repairs: quarantine
    assert not report.ok and report.problems[0].sha1 == bad.sha1
    assert fresh.index.get(ns, bad.sha1) is None and fresh.index.get(ns, good.sha1)
    assert not os.path.exists(path)
    assert len(fresh.quarantined_files()) == 1
    assert verify(fresh).ok  # nothing left to complain about


def test_budget_evicts_leaves_and_skips_a_file_that_cannot_fit(tmp_path):
    now = [0.0]
    store, ns = make(tmp_path, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    plan_a, _ = save(store, ns, prompt(1), 48, rng)
    size = store.index.get(ns, plan_a.sha1).size
    store.space_bytes = int(size * 2.5)
    plan_b, _ = save(store, ns, prompt(2), 48, rng)
    now[0] = 10
    plan_c, _ = save(store, ns, prompt(3), 48, rng)  # over budget: the oldest leaf goes
    assert {e.sha1 for e in store.index.entries()} == {plan_b.sha1, plan_c.sha1}
    assert not os.path.exists(store.path(ns, plan_a.sha1))
    store.space_bytes = size // 2  # a budget below one file: the save is skipped...
    with pytest.raises(SaveSkipped, match="no_space"):
        save(store, ns, prompt(4), 48, rng)
    # ...and nothing was evicted for it, nothing half-written is left.
    assert {e.sha1 for e in store.index.entries()} == {plan_b.sha1, plan_c.sha1}
    assert not [n for n in os.listdir(store.ns_dir(ns)) if n.startswith(".tmp-")]
    assert store.stats.evicted == 1 and store.stats.skipped_saves == 1


def test_a_delta_never_evicts_its_own_parent(tmp_path):
    """At a full budget the new delta's parent is a leaf with the lowest score (a root,
    few tokens per byte); before, the save made room by evicting it and broke its own
    chain from birth."""
    now = [0.0]
    store, ns = make(tmp_path, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    p = prompt(5)
    root, _ = save(store, ns, p, 48, rng)  # the parent: oldest, lowest score
    now[0] = 100
    other, _ = save(store, ns, prompt(6), 176, rng)
    store.space_bytes = store.index.total_bytes + 10  # full
    now[0] = 200
    child, _ = save(store, ns, p, 112, rng)  # a delta on root: something must go
    assert store.index.get(ns, root.sha1) is not None and child.parent == root.sha1
    assert store.index.get(ns, other.sha1) is None  # the other leaf went instead
    assert store.index.chain(ns, child.sha1) is not None
    assert verify(store).ok


def test_a_delta_whose_parent_is_gone_is_not_written(tmp_path):
    """A parent save that failed (ENOSPC) or was evicted by another process leaves its
    child without a chain; the child is skipped, never written as an orphan."""
    store, ns = make(tmp_path)
    p = prompt(7)
    rng = np.random.default_rng(0)
    root, _ = save(store, ns, p, 48, rng)
    plan = planner(store).plan_save(ns, p, 112, Reason.COLD)
    assert plan.parent == root.sha1
    os.unlink(store.path(ns, root.sha1))  # gone meanwhile
    from synth import pages

    with pytest.raises(SaveSkipped, match="parent_gone"):
        store.write(ns, plan.sha1, encode(plan, p, pages(rng, plan)))
    assert not os.path.exists(store.path(ns, plan.sha1))
    assert verify(store).ok


def test_a_parent_deleted_within_one_timestamp_tick_is_still_seen_gone(tmp_path, monkeypatch):
    """The index notices other processes' changes by the directory's mtime, and file
    system timestamps are coarse (a jiffy on ext4, a second on some): when this store's
    last refresh, its own temp file and another replica's eviction of the parent fall in
    one tick, the mtime says "unchanged" and the child used to be committed as an orphan.
    The utimes pin that tick: the directory's mtime is "now" when this store looks, and
    stays so through the eviction and the temp file."""
    from vllm_kvdisk.storage import fsdir

    store, ns = make(tmp_path)
    p = prompt(8)
    rng = np.random.default_rng(0)
    root, _ = save(store, ns, p, 48, rng)
    plan = planner(store).plan_save(ns, p, 112, Reason.COLD)
    assert plan.parent == root.sha1
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


def test_an_unreachable_watermark_skips_the_save_and_evicts_nothing(tmp_path):
    """Something else filled the volume: before, every save evicted everything but the new
    file and then wrote anyway, wiping the cache."""
    free = [100 << 20]
    store, ns = make(tmp_path, statvfs=free_space(free), min_free_bytes=50 << 20)
    rng = np.random.default_rng(0)
    kept = [save(store, ns, prompt(10 + i), 48, rng)[0].sha1 for i in range(3)]
    free[0] = 10 << 20  # another tenant took the disk: the watermark cannot be met
    with pytest.raises(SaveSkipped, match="no_space"):
        save(store, ns, prompt(20), 48, rng)
    assert {e.sha1 for e in store.index.entries()} == set(kept)
    free[0] = (50 << 20) - 1000  # 1000 bytes short once the file is written: one leaf goes
    save(store, ns, prompt(21), 48, rng)
    assert len(store.index) == 3 and store.stats.evicted == 1


def test_enospc_while_writing_makes_room_once_and_leaves_no_temp_file(tmp_path, monkeypatch):
    from vllm_kvdisk.storage import fsdir

    store, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    old = save(store, ns, prompt(30), 48, rng)[0]
    real = fsdir.writev_all
    calls = []

    def full_once(fd, buffers):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(fd, buffers)

    monkeypatch.setattr(fsdir, "writev_all", full_once)
    store.space_bytes = 1 << 30
    new = save(store, ns, prompt(31), 48, rng)[0]
    assert len(calls) == 2 and store.index.get(ns, new.sha1) and store.index.get(ns, old.sha1)

    def always_full(fd, buffers):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fsdir, "writev_all", always_full)
    with pytest.raises(OSError):
        save(store, ns, prompt(32), 48, rng)
    assert not [n for n in os.listdir(store.ns_dir(ns)) if n.startswith(".tmp-")]
    assert store.stats.write_failures == 1


def test_ranks_of_one_engine_evict_a_checkpoint_together(tmp_path):
    """With TP 2 each rank writes its own namespace; a checkpoint is usable only while both
    ranks' files are there. Before, each rank's eviction chose its own victims, so at a
    full budget rank 0 could drop A while rank 1 dropped B: both unusable, their other
    halves dead weight. Now the victim goes from every rank's namespace at once, and
    another engine's namespace (a different TP group) is untouched."""
    from dataclasses import replace

    now = [0.0]
    store = Store(str(tmp_path / "cache"), space_bytes=1 << 30, clock=lambda: now[0])
    tp = replace(FP, tp_size=2)
    ranks = [store.ensure_namespace(replace(tp, tp_rank=r)) for r in (0, 1)]
    other = store.ensure_namespace(replace(tp, model="other"))
    rng = np.random.default_rng(0)
    plans = []
    for i, (first, second) in enumerate([(0, 1), (1, 0), (0, 1)]):  # ranks finish in turn
        now[0] = 10 * i
        plan, _ = save(store, ranks[first], prompt(20 + i), 48, rng)
        now[0] = 10 * i + 5
        save(store, ranks[second], prompt(20 + i), 48, rng)
        plans.append(plan)
    now[0] = 1
    kept, _ = save(store, other, prompt(30), 48, rng)
    size = store.index.get(ranks[0], plans[0].sha1).size
    store.space_bytes = store.index.total_bytes + size // 2  # one more file does not fit
    now[0] = 100
    new, _ = save(store, ranks[0], prompt(40), 48, rng)
    on_disk = {(ns, e.sha1) for ns in ranks + [other] for e in store.index.namespace_entries(ns)}
    # The least recently used checkpoint went from both ranks, nothing else did.
    assert not {(ns, plans[0].sha1) for ns in ranks} & on_disk
    assert all((ns, p.sha1) in on_disk for ns in ranks for p in plans[1:])
    assert (other, kept.sha1) in on_disk and (ranks[0], new.sha1) in on_disk
    assert store.stats.evicted == 2
    assert verify(store).ok


def test_parent_is_kept_while_children_exist(tmp_path):
    store, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    p = prompt()
    root, _ = save(store, ns, p, 48, rng)
    child, _ = save(store, ns, p, 112, rng)
    evicted = store.evict(1)
    assert [e.sha1 for e in evicted] == [child.sha1]
    assert store.index.get(ns, root.sha1) is not None


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
    os.unlink(worker.path(ns, a.sha1))  # kvdisk gc in another process
    sched.refresh(ns)
    assert sched.index.get(ns, a.sha1) is None
    # Replaced under the same name by another replica: re-indexed, not "inconsistent".
    worker.refresh(ns)
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


def _replica(root, seed, count, budget, queue):
    store = Store(root, space_bytes=budget)
    ns = store.ensure_namespace(FP)
    rng = np.random.default_rng(seed)
    peak, done = 0, 0
    for i in range(count):
        p = prompt(1000 + i % 6, 400)  # both replicas extend the same six conversations
        for length in (48, 112, 176, 240):
            try:
                save(store, ns, p, length, rng)
                done += 1
            except (SaveSkipped, ValueError):
                pass
            total = 0
            for name in os.listdir(store.ns_dir(ns)):
                if name.endswith(".kv"):  # the other replica may evict it meanwhile
                    with contextlib.suppress(FileNotFoundError):
                        total += os.path.getsize(os.path.join(store.ns_dir(ns), name))
            peak = max(peak, total)
    queue.put((peak, done))


def test_two_replicas_keep_one_budget_and_never_orphan_each_others_children(tmp_path):
    """Each replica used to enforce the budget on its own stale view: two replicas with a
    200 kB budget held 348 kB, and one evicted a parent the other had just extended."""
    root = str(tmp_path / "cache")
    probe = Store(root, space_bytes=1 << 30)
    ns = probe.ensure_namespace(FP)
    save(probe, ns, prompt(999), 48, np.random.default_rng(0))
    one = probe.index.total_bytes
    probe.gc_to(0)
    budget = one * 9
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(root, s, 12, budget, queue)) for s in (1, 2)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert all(done > 0 for _, done in results)
    # One budget, whatever the interleaving (a file may be counted while its rename lands).
    assert max(peak for peak, _ in results) <= budget + one * 3
    final = Store(root, space_bytes=budget)
    final.scan()
    assert final.index.total_bytes <= budget
    report = verify(final)
    assert report.ok, report.problems  # no orphans, nothing corrupt


def test_two_processes_write_one_directory_and_a_reader_sees_them(tmp_path):
    root = str(tmp_path / "cache")
    reader = Store(root, space_bytes=1 << 30)
    ns = reader.ensure_namespace(FP)
    reader.scan()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(root, s, 3, 1 << 30, queue)) for s in (1, 2)]
    for proc in procs:
        proc.start()
    [queue.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert reader.refresh(ns)
    assert len(reader.index) >= 4 and verify(reader).ok
    leaves = [e for e in reader.index.entries() if not reader.index.children(ns, e.sha1)]
    for e in leaves:
        os.unlink(reader.path(ns, e.sha1))
    reader.refresh(ns)
    assert len(reader.index) == len(set(reader.index.keys())) and verify(reader).ok


def test_open_reader_survives_concurrent_eviction(tmp_path):
    store, ns = make(tmp_path)
    plan, layers = save(store, ns, prompt(), 48, np.random.default_rng(0))
    with store.open(ns, plan.sha1) as (fd, meta, _):
        other = Store(store.root, space_bytes=1 << 30)
        other.scan()
        other.gc_to(0)  # another process evicts everything
        assert not os.path.exists(store.path(ns, plan.sha1))
        buf = bytearray(meta.offsets.layer_bytes)
        read_layer_into(fd, meta, 0, memoryview(buf))
        assert bytes(buf) == layers[0]


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


def test_symlinks_in_the_directory_are_never_followed(tmp_path):
    store, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    plan, _ = save(store, ns, prompt(70), 48, rng)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.bin"
    victim.write_bytes(b"\0" * 4096)
    # 1. a .kv name that is a symlink: never indexed, touch() never writes through it
    link = os.path.join(store.ns_dir(ns), "f" * 40 + ".kv")
    os.symlink(victim, link)
    # 2. a namespace directory that is a symlink to someone else's files
    os.symlink(outside, os.path.join(store.root, "0123456789abcdef"))
    (outside / ("e" * 40 + ".kv")).write_bytes(open(store.path(ns, plan.sha1), "rb").read())
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()
    assert {e.sha1 for e in fresh.index.entries()} == {plan.sha1}
    fresh.touch(ns, "f" * 40)
    fresh.gc_to(0)
    assert victim.read_bytes() == b"\0" * 4096 and (outside / ("e" * 40 + ".kv")).exists()
    # 3. a quarantine that is a symlink: a bad file is deleted in place, never moved out
    os.symlink(outside, os.path.join(store.root, "quarantine"))
    bad, _ = save(store, ns, prompt(71), 48, rng)
    store.quarantine(ns, bad.sha1, "checksum mismatch")
    assert not os.path.exists(store.path(ns, bad.sha1))
    assert sorted(os.listdir(outside)) == ["e" * 40 + ".kv", "victim.bin"]
    # 4. a lock file that is a symlink: the lock is refused (a skipped save), never opened
    os.symlink(victim, os.path.join(store.root, ".lock.new"))
    os.replace(os.path.join(store.root, ".lock.new"), os.path.join(store.root, ".lock"))
    with pytest.raises(OSError):
        store.evict(1)
    assert victim.read_bytes() == b"\0" * 4096


def test_a_root_others_can_write_is_refused_unless_allowed(tmp_path):
    from vllm_kvdisk.storage.fsdir import UnsafeDirectory

    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeDirectory, match="writable by its group or by everyone"):
        Store(str(root), space_bytes=1 << 30)
    Store(str(root), space_bytes=1 << 30, allow_shared_dir=True)  # an explicit choice
    Store(str(root), space_bytes=1 << 30, readonly=True)  # inspection tools may look


def test_temp_files_dead_writers_go_after_the_grace_live_writers_never(tmp_path):
    import fcntl

    store, ns = make(tmp_path)
    d = store.ns_dir(ns)
    dead = os.path.join(d, ".tmp-" + "a" * 40 + ".kv-1-dead")
    live = os.path.join(d, ".tmp-" + "b" * 40 + ".kv-2-live")
    for path in (dead, live):
        with open(path, "wb") as fh:
            fh.write(b"x" * 1000)
        os.utime(path, (0, 0))  # older than the grace period
    holder = os.open(live, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a writer in another process, still writing
    try:
        report = verify(Store(store.root, space_bytes=1 << 30))  # --fix
        assert report.writing == 1
        assert not os.path.exists(dead) and os.path.exists(live)
    finally:
        os.close(holder)
    # Just made and not locked yet: within the grace its writer may still be about to lock it.
    young = os.path.join(d, ".tmp-" + "c" * 40 + ".kv-3-young")
    with open(young, "wb") as fh:
        fh.write(b"x" * 1000)
    Store(store.root, space_bytes=1 << 30).scan()
    assert os.path.exists(young)


def test_the_lock_is_waited_on_with_a_timeout(tmp_path):
    import fcntl

    store, ns = make(tmp_path, lock_timeout_s=0.3)
    rng = np.random.default_rng(0)
    holder = os.open(os.path.join(store.root, ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a stuck process (an NFS unlink that never returns)
    try:
        with pytest.raises(SaveSkipped, match="lock_timeout"):
            save(store, ns, prompt(80), 48, rng)
    finally:
        os.close(holder)
    save(store, ns, prompt(80), 48, rng)  # free again


def test_quarantine_stays_bounded(tmp_path):
    store, ns = make(tmp_path, quarantine_max_bytes=1)
    rng = np.random.default_rng(0)
    for i in range(3):
        plan, _ = save(store, ns, prompt(90 + i), 48, rng)
        store.quarantine(ns, plan.sha1, "checksum mismatch")
    assert len(store.quarantined_files()) <= 1 and store.stats.quarantined == 3


def test_remove_namespace_leaves_readers_a_miss(tmp_path):
    store, ns = make(tmp_path)
    plan, layers = save(store, ns, prompt(95), 48, np.random.default_rng(0))
    with store.open(ns, plan.sha1) as (fd, meta, _):
        assert Store(store.root, space_bytes=1 << 30).remove_namespace(ns) == 1
        buf = bytearray(meta.offsets.layer_bytes)
        read_layer_into(fd, meta, 0, memoryview(buf))  # an open reader finishes its read
        assert bytes(buf) == layers[0]
    store.refresh(ns)
    assert len(store.index) == 0 and not os.path.exists(store.ns_dir(ns))
    assert save(store, ns := store.ensure_namespace(FP), prompt(95), 48,
                np.random.default_rng(0))[0].parent is None

