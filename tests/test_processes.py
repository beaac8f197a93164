"""Two processes on one directory (spawned, racing freely): one budget between them, no
orphans, and a third store sees their files."""

import contextlib
import multiprocessing as mp
import os

import numpy as np
from synth import FP, prompt, save

from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify


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
