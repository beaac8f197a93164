"""Writes under one budget: evictions of leaves only, never a new file's own parent,
saves that cannot fit (budget, watermark, ENOSPC) skipped without evicting, TP ranks
losing a checkpoint together."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
from synth import FP, child_of_a_root, encode, make, prompt, save

from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify


def free_space(amount):
    """A statvfs stand-in reporting ``amount[0]`` bytes free."""
    return lambda fd: SimpleNamespace(f_bavail=amount[0] // 4096, f_frsize=4096)


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
    store, ns, p, root, plan, rng = child_of_a_root(tmp_path, 7)
    os.unlink(store.path(ns, root.sha1))  # gone meanwhile
    from synth import pages

    with pytest.raises(SaveSkipped, match="parent_gone"):
        store.write(ns, plan.sha1, encode(plan, p, pages(rng, plan)))
    assert not os.path.exists(store.path(ns, plan.sha1))
    assert verify(store).ok


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


def test_a_save_whose_victims_never_check_out_evicts_nothing(tmp_path, monkeypatch):
    """Each eviction victim is stat'ed before it goes; one that is not the file its entry
    says (another replica saved, hit or replaced it meanwhile) makes the plan be made
    again. When every plan failed its check, even after a listing, the last unchecked one
    was carried out: files deleted on a view the disk had just contradicted (maybe one
    another replica had just written, with its children, or its lines journaled with
    the old inode), and the save landed over the budget's decision."""
    now = [0.0]
    store, ns = make(tmp_path, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    plan_a, _ = save(store, ns, prompt(1), 48, rng)
    store.space_bytes = int(store.index.get(ns, plan_a.sha1).size * 1.5)
    checks = []
    monkeypatch.setattr(store.scanner, "verify_victims", lambda plan: checks.append(plan) and False)
    now[0] = 10
    with pytest.raises(SaveSkipped, match="no_space"):
        save(store, ns, prompt(2), 48, rng)  # A must go for it: its check never passes
    assert checks  # the plans were made (and checked)
    assert os.path.exists(store.path(ns, plan_a.sha1))  # nothing evicted unchecked
    assert {e.sha1 for e in store.index.entries()} == {plan_a.sha1}
    assert store.stats.evicted == 0


def test_a_close_that_reports_an_error_after_a_read_fails_no_save(tmp_path, monkeypatch):
    """GlusterFS's FUSE client answered ENOENT to the close of ``namespace.json`` once
    other processes had replaced it by renames (two replicas starting at once): the read
    was done, yet the error failed the save that was evicting (it reads the namespace's TP
    group there), and the same holds for the journal and the headers a listing reads.
    Every descriptor only read through reports such an error here: saves on two replicas
    (each following the other's journal lines), a start that reads every header, a
    lookup's read of stored ids, ``verify`` and ``kvdisk inspect`` go on."""
    import errno

    from vllm_kvdisk.ops.cli import main as kvdisk
    from vllm_kvdisk.storage import fsdir

    store, ns = make(tmp_path)
    other = Store(store.root, space_bytes=store.space_bytes)
    other.scan()
    rng = np.random.default_rng(0)
    first, _ = save(store, ns, prompt(1), 48, rng)
    size = store.index.get(ns, first.sha1).size
    store.space_bytes = other.space_bytes = int(size * 2.5)
    real_open, real_close = fsdir.open_regular, os.close
    read_only: set[int] = set()
    failed_closes = []

    def open_regular(name, dir_fd=None, **kw):
        fd = real_open(name, dir_fd, **kw)
        if kw.get("flags", os.O_RDONLY) == os.O_RDONLY:
            read_only.add(fd)
        return fd

    def close(fd):
        real_close(fd)
        if fd in read_only:
            read_only.discard(fd)
            failed_closes.append(fd)
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(fsdir, "open_regular", open_regular)
    monkeypatch.setattr(os, "close", close)
    saved = [first.sha1]
    for i in range(2, 8):
        plan, _ = save((store, other)[i % 2], ns, prompt(i), 48, rng)
        saved.append(plan.sha1)
    fresh = Store(store.root, space_bytes=store.space_bytes)
    fresh.scan()
    last = fresh.index.get(ns, saved[-1])
    ids = fresh.read_ids(last, 0, last.tokens)  # a lookup's read of the stored ids
    report = verify(fresh)
    inspected = kvdisk(["inspect", fresh.path(ns, saved[-1])])
    monkeypatch.undo()
    assert failed_closes  # the error was injected where reads closed their descriptors
    on_disk = {e.sha1 for e in fresh.index.entries()}
    assert on_disk == set(saved[-2:]), "the last saves landed, evicting the oldest"
    assert store.stats.write_failures == other.stats.write_failures == 0
    assert ids is not None and len(ids) == last.tokens
    assert report.ok and report.checked == 2, report.problems
    assert inspected == 0
