"""The scheduler half's index follows what real workers report (``WorkerReport``): files
written and removed in one step, in whatever order they happened."""

import os
import sys

import numpy as np
import pytest
import torch
import vllm_api as api

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from workers import BLOCK, make_worker, save_job  # noqa: E402

from vllm_kvdisk.connector.jobs import LoadFile, LoadJob, Scope, StepMeta  # noqa: E402

IDS = np.arange(5_000, 5_000 + 32 * BLOCK, dtype="<u4")


@pytest.fixture
def saved(make_engine, tmp_path):
    """(scheduler half, worker, save job): a 1 MB budget, one file saved and reported."""
    side = make_engine(kv_disk_space_mb=1).kvdisk
    torch.manual_seed(0)
    caches = {f"model.layers.{i}.attn": torch.rand(32, 8, BLOCK, 128) for i in range(2)}
    w = make_worker(tmp_path, caches, name="kv", kv_disk_space_mb=1, kv_disk_io_threads=1)
    try:
        first = save_job(IDS, [1, 2], text=b"x" * 2 * BLOCK)
        w.wait_for_save(StepMeta(saves=[first]))
        w.drain()
        side.update_connector_output(api.kv_output(meta=w.build_connector_worker_meta()))
        assert side.store.index.get(first.plan.ns, first.plan.sha1) is not None
        yield side, w, first
    finally:
        w.shutdown()


def evict_and_save_again(w, first):
    """Save a file that evicts ``first``, then ``first``'s prefix again (evicting the
    other): a new file under ``first``'s name. Returns the other save job."""
    big = save_job(IDS, [3, 4, 5, 6, 7, 8], text=b"y" * 6 * BLOCK)  # evicts it
    again = save_job(IDS, [9, 10], text=first.text)  # and evicts big
    for job in (big, again):
        w.wait_for_save(StepMeta(saves=[job]))
        w.drain()
    return big


def inode_on_disk(side, ns, sha1):
    fd = side.store.open_file(ns, sha1)
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def test_a_file_evicted_and_saved_again_in_one_step_stays_in_the_index(saved):
    """A worker evicted a file and, in the same step, saved its prefix again (the
    scheduler, following the journal, had seen it go and planned it anew). Its report
    said both: the new file written, the old one removed. Removals were applied by name
    after the writes, so the new file, on disk, left the scheduler's index: never offered
    to a lookup until a listing found it again."""
    side, w, first = saved
    ns, sha1 = first.plan.ns, first.plan.sha1
    # Held open, its inode is not handed to the next file (as when any other file took
    # it): the file saved again is told from the one evicted.
    held = side.store.open_file(ns, sha1)
    try:
        big = evict_and_save_again(w, first)
        report = w.build_connector_worker_meta()
    finally:
        os.close(held)
    assert report is not None
    assert sorted(e.sha1 for e in report.written) == sorted([big.plan.sha1, sha1])
    side.update_connector_output(api.kv_output(meta=report))
    entry = side.store.index.get(ns, sha1)  # the file saved again is there
    assert entry is not None and entry.inode == inode_on_disk(side, ns, sha1)
    assert side.store.index.get(ns, big.plan.sha1) is None  # evicted for it: gone


def test_a_load_that_found_a_file_replaced_leaves_the_new_file_in_the_index(saved):
    """A load planned from a file the worker then evicted and saved again under the same
    name (a new inode) found it replaced: a stale file, a miss. The step's report said
    both: the new file written, the old one stale. Stale files were dropped by name, so
    the new file, on disk and sound, left the scheduler's index (and a KV-event consumer
    was told it was removed) until a listing found it again."""
    side, w, first = saved
    ns, sha1 = first.plan.ns, first.plan.sha1
    planned = side.store.index.get(ns, sha1)
    job = LoadJob(
        "r",
        Scope(),
        [LoadFile(sha1, 0, 2 * BLOCK, 2 * BLOCK, inode=planned.inode)],
        0,
        [20, 21],
        IDS[: 2 * BLOCK].tobytes(),
        indexed_ns=ns,
    )
    held = side.store.open_file(ns, sha1)  # its inode is not handed to the new file
    try:
        evict_and_save_again(w, first)
        assert w.loads.load(job) == [20, 21]  # planned from the old file: stale
        report = w.build_connector_worker_meta()
    finally:
        os.close(held)
    assert report is not None
    assert [tuple(e[:2]) for e in report.stale] == [(ns, sha1)]
    side.update_connector_output(api.kv_output(meta=report))
    inode = inode_on_disk(side, ns, sha1)
    assert inode != planned.inode
    entry = side.store.index.get(ns, sha1)
    assert entry is not None and entry.inode == inode
    assert w.store.index.get(ns, sha1) is not None  # the worker's own view keeps it too
