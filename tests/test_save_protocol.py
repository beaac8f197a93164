"""Saves leave the engine step: the protocol, proven with a page mover whose copies are
held at a gate (a delaying mover) and a store whose writes are held at another.

* ``wait_for_save`` hands the copy over and returns while it still runs;
* a finished request is named in ``finished_sending`` (its blocks go back) only after
  its copy completed; a preempted one's copy completes in ``handle_preemptions``, before
  the next forward may write into its blocks;
* a slow write never delays a load (separate threads);
* staging in flight has a cap: past it a save is skipped as ``busy``, never waited for.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import threading
from concurrent.futures import wait

import numpy as np
import pytest
import torch
from workers import BLOCK, fingerprint, make_worker, save_job
from workers import save as save_now

from vllm_kvdisk.connector.jobs import (
    LoadFile,
    LoadJob,
    SaveJob,
    Scope,
    StepMeta,
    WorkerReport,
)
from vllm_kvdisk.connector.worker import WorkerSide
from vllm_kvdisk.core.compat import Placement, Shard

BLOCKS = 32
IDS = np.arange(7_000, 7_000 + BLOCKS * BLOCK, dtype="<u4")
WAIT = 60  # seconds before a wait that should end counts as a hang


def job(req: str, blocks: list[int], seed: int) -> SaveJob:
    return save_job(IDS, blocks, req=req, text=f"{seed}:".encode() + b"x" * len(blocks) * BLOCK)


def load_job(sha1: str, blocks: int, targets: list[int]) -> LoadJob:
    tokens = blocks * BLOCK
    return LoadJob(
        "load", Scope(), [LoadFile(sha1, 0, tokens, tokens)], 0, targets, IDS[:tokens].tobytes()
    )


class Gate:
    """Wraps a function so each call waits until the test opens the gate."""

    def __init__(self, fn):
        self.fn, self.entered, self.open = fn, threading.Event(), threading.Event()
        self.finished = 0

    def __call__(self, *args, **kwargs):
        self.entered.set()
        if not self.open.wait(WAIT):
            raise TimeoutError("the test never opened the gate")
        out = self.fn(*args, **kwargs)
        self.finished += 1
        return out


@pytest.fixture
def side(tmp_path):
    def make(**extra):
        torch.manual_seed(0)
        caches = {f"model.layers.{i}.attn": torch.rand(BLOCKS, 8, BLOCK, 128) for i in range(2)}
        w = make_worker(tmp_path, caches, **{"kv_disk_io_threads": 1, **extra})
        made.append(w)
        return w, list(caches.values())

    made: list[WorkerSide] = []
    yield make
    for w in made:
        w.shutdown()


def test_wait_for_save_returns_while_the_copy_runs_and_blocks_wait_for_it(side):
    w, layers = side()
    gate = Gate(w.mover.gather)
    w.mover.gather = gate
    want = [t[[1, 2, 3]].clone() for t in layers]
    save = job("r", [1, 2, 3], seed=1)
    w.wait_for_save(StepMeta(saves=[save]))  # returns with the copy held at the gate
    assert gate.entered.wait(WAIT) and gate.finished == 0
    # The request finished in that step; the scheduler holds its blocks.
    w.wait_for_save(StepMeta(holds=["r"]))
    assert w.get_finished({"r"}) == (None, None)  # copy running: blocks not given back
    assert w.get_finished(set()) == (None, None)
    gate.open.set()
    w.drain()
    assert gate.finished == 1
    assert w.get_finished(set()) == ({"r"}, None)  # now they go back, once
    assert w.get_finished(set()) == (None, None)
    # The file holds the pages as they were when the step ended.
    assert w.loads.load(load_job(save.plan.sha1, 3, [20, 21, 22])) == []
    for t, page in zip(layers, want):
        assert torch.equal(t[[20, 21, 22]], page)


def test_a_preempted_requests_copy_completes_before_the_next_forward(side):
    w, layers = side()
    gate = Gate(w.mover.gather)
    w.mover.gather = gate
    want = [t[[4, 5]].clone() for t in layers]
    save = job("p", [4, 5], seed=2)
    w.wait_for_save(StepMeta(saves=[save]))
    assert gate.entered.wait(WAIT)
    threading.Timer(0.2, gate.open.set).start()
    w.handle_preemptions(StepMeta(flush=["p"]))  # the next step: p was preempted
    assert gate.finished == 1  # its copy is done before anything may write its blocks
    for t in layers:
        t[[4, 5]] = 0  # the next forward reuses the blocks
    w.drain()
    assert w.loads.load(load_job(save.plan.sha1, 2, [10, 11])) == []
    for t, page in zip(layers, want):
        assert torch.equal(t[[10, 11]], page)


def test_a_slow_write_never_delays_a_load(side):
    """One thread of each kind: before, loads and writes shared one pool, and a load
    queued behind a write stuck in its fsync."""
    w, layers = side()
    first = job("a", [0, 1], seed=3)
    w.wait_for_save(StepMeta(saves=[first]))
    w.drain()
    gate = Gate(w.store.write)
    w.store.write = gate
    w.wait_for_save(StepMeta(saves=[job("b", [6, 7], seed=4)]))
    assert gate.entered.wait(WAIT)  # the write is stuck
    w.start_load_kv(StepMeta(loads=[load_job(first.plan.sha1, 2, [12, 13])]))
    fut, _ = w.loads.pending["load"]
    try:
        assert fut.result(WAIT) == []  # restored while the write still waits
        assert gate.finished == 0
    finally:
        gate.open.set()
    for t in layers:
        assert torch.equal(t[[12, 13]], t[[0, 1]])


def test_saves_past_the_staging_cap_are_skipped_as_busy(side):
    w, _ = side(kv_disk_staging_inflight_mb=3)  # a page is 64 KiB: a block of 2 layers 128 KiB
    gate = Gate(w.mover.gather)
    w.mover.gather = gate
    big, small = job("a", list(range(20)), 5), job("b", [20], 6)
    more = job("c", [21, 22, 23, 24], 7)
    w.wait_for_save(StepMeta(saves=[big]))  # 2.5 MiB held
    w.wait_for_save(StepMeta(saves=[small, more]))  # 128 KiB fits, 512 KiB more does not
    report = w.build_connector_worker_meta()
    assert report is not None and report.failed_saves == [(more.plan.ns, more.plan.sha1)]
    assert w.stats.snapshot()["saves_skipped"] == {"busy": 1}
    gate.open.set()
    w.drain()
    report = w.build_connector_worker_meta()
    assert sorted(e.sha1 for e in report.written) == sorted([big.plan.sha1, small.plan.sha1])
    assert w._staged == 0  # every byte given back
    page = 64 << 10
    assert w.staging_peak == 21 * 2 * page <= 3 << 20  # the most ever held, under the cap
    assert w.get_kv_connector_stats().data["staging_peak_bytes"] == w.staging_peak


def test_io_threads_run_on_the_cores_vllm_reserved_not_the_compute_ones(side, monkeypatch):
    """vLLM's CPU backend binds a worker to its compute cores and reserves others of the
    node for the scheduler and a connector's transfers. The worker's threads inherited
    the binding: saves and loads ran on the compute core while the reserved one idled.
    Here the test's thread plays a worker bound to CPU 0 under a process allowed 0-1."""

    def cpus() -> set[int]:
        return set(os.sched_getaffinity(0))

    allowed = cpus()
    assert len(allowed) >= 2, "this test needs a machine with two CPUs"
    compute, spare = min(allowed), allowed - {min(allowed)}
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    engine = subprocess.Popen(["sleep", "600"])  # the engine process: allowed every CPU
    monkeypatch.setattr(os, "getppid", lambda: engine.pid)
    os.sched_setaffinity(0, {compute})  # this thread only, as vLLM binds a worker
    try:
        w, _ = side()  # registers its caches: the plan is made now
        seen: dict[str, set[int]] = {}
        gather, write, opened = w.mover.gather, w.store.write, w.store.open_file
        w.mover.gather = lambda *a, **k: (seen.setdefault("copy", cpus()), gather(*a, **k))[1]
        w.store.write = lambda *a, **k: (seen.setdefault("write", cpus()), write(*a, **k))[1]
        w.store.open_file = lambda *a, **k: (seen.setdefault("load", cpus()), opened(*a, **k))[1]
        save = job("c", [2, 3], seed=7)
        w.wait_for_save(StepMeta(saves=[save]))
        w.drain()
        w.start_load_kv(StepMeta(loads=[load_job(save.plan.sha1, 2, [30, 31])]))
        fut, _ = w.loads.pending["load"]
        assert fut.result(WAIT) == []
    finally:
        os.sched_setaffinity(0, allowed)
        engine.kill()
        engine.wait()
    assert seen == {"copy": spare, "write": spare, "load": allowed}, seen


def test_a_held_request_is_released_however_many_steps_its_copy_took(side):
    """An idle engine runs empty steps back to back while a copy runs. A held request was
    released only within 4 steps of its finishing: a slower copy leaked its blocks, and
    the engine kept stepping (both cores spinning) for good."""
    w, _ = side()
    gate = Gate(w.mover.gather)
    w.mover.gather = gate
    w.wait_for_save(StepMeta(saves=[job("slow", [1, 2], seed=8)]))
    assert gate.entered.wait(WAIT)
    w.wait_for_save(StepMeta(holds=["slow"]))
    assert w.get_finished({"slow"}) == (None, None)
    for _ in range(10):  # empty steps while the copy runs
        w.wait_for_save(StepMeta())
        assert w.get_finished(set()) == (None, None)
    gate.open.set()
    w.drain()
    assert w.get_finished(set()) == ({"slow"}, None)
    assert w.get_finished(set()) == (None, None)


def test_a_save_that_cannot_start_is_reported_and_the_steps_other_saves_go_on(side):
    """A fault starting one save's copy (here the event after the forward cannot be
    recorded) gave up the whole step inside ``wait_for_save``'s guard: the save was left
    counted as copying (its finished request never named in finished_sending: blocks
    leaked, the engine stepping for good), its reservation never reported (the scheduler's
    index pending for good), and the step's later saves never started nor confirmed."""
    w, layers = side()
    mark = w.mover.mark
    calls = []

    def broken_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return mark()

    w.mover.mark = broken_once
    first, second = job("a", [1, 2], seed=11), job("b", [3, 4], seed=12)
    w.wait_for_save(StepMeta(saves=[first, second], holds=["a", "b"]))
    with w._lock:
        pending = [done for done, _ in w._inflight.values()]
    _, stuck = wait(pending, timeout=WAIT)
    assert not stuck  # (a save never ended left every later delta of it waiting, too)
    report = w.build_connector_worker_meta()
    assert report is not None
    assert sorted(report.copied) == ["a", "b"]  # each job confirmed once: holds can end
    assert (first.plan.ns, first.plan.sha1) in report.failed_saves  # its reservation goes
    assert [e.sha1 for e in report.written] == [second.plan.sha1]
    assert w.get_finished(set()) == ({"a", "b"}, None)


def test_one_text_saved_in_two_namespaces_at_once_keeps_each_deltas_parent(side):
    """Two tenants (cache salts) with one system prompt save files of one name, each in
    its own namespace, at once. The saves in flight were known by name alone: the second
    took the first's place, the first's end then dropped the second's, and the second's
    delta no longer waited for its parent's write: it was skipped (``parent_gone``) while
    that parent was still being written, and the tenant's conversation stayed uncached."""
    w, _ = side(kv_disk_io_threads=2)
    ns_a, ns_b = w.namespaces.name("", "a" * 16), w.namespaces.name("", "b" * 16)
    text = b"system prompt " * 8  # the same rendered text: one file name
    roots = [
        dataclasses.replace(save_job(IDS, [1, 2], text=text, req=r, ns=ns), scope=Scope("", s))
        for r, ns, s in (("a", ns_a, "a" * 16), ("b", ns_b, "b" * 16))
    ]
    root = roots[0].plan.sha1
    child = dataclasses.replace(
        save_job(IDS, [3], start=2 * BLOCK, parent=root, text=text + b"more", req="b", ns=ns_b),
        scope=Scope("", "b" * 16),
    )
    write, gate = w.store.write, threading.Event()

    def held_for_b(ns, sha1, *args, **kwargs):
        if ns == ns_b and sha1 == root and not gate.wait(WAIT):
            raise TimeoutError("the test never opened the gate")
        return write(ns, sha1, *args, **kwargs)

    w.store.write = held_for_b
    w.wait_for_save(StepMeta(saves=roots))
    written: list[str] = []
    for _ in range(WAIT * 10):  # until tenant a's root landed (b's waits at the gate)
        report = w.build_connector_worker_meta()
        written += [e.ns for e in report.written] if report else []
        if ns_a in written:
            break
        threading.Event().wait(0.1)
    assert written == [ns_a]
    w.wait_for_save(StepMeta(saves=[child]))  # the next step: b's delta on b's root
    threading.Timer(0.5, gate.set).start()
    w.drain()
    report = w.build_connector_worker_meta()
    assert report is not None and not report.failed_saves
    assert sorted((e.ns, e.sha1) for e in report.written) == sorted(
        [(ns_b, root), (ns_b, child.plan.sha1)]
    )


def test_on_a_tp_rank_past_0_a_deltas_parent_is_not_evicted_while_the_delta_is_written(side):
    """A save keeps the parents of this process's saves in flight from its evictions. A job
    names TP rank 0's namespace (the scheduler plans there); rank 1 writes its own shard's
    namespace, where those keys named nothing: its own next save evicted the parent, the
    delta was skipped (``parent_gone``), and rank 1 lacked a checkpoint rank 0 has."""
    fp = dataclasses.replace(fingerprint(), tp_size=2, tp_rank=1)
    w, _ = side(
        kv_disk_io_threads=2,
        kv_disk_space_mb=1,
        fp=fp,
        placement=Placement(tp_rank=1, shard=Shard(1, 2, True)),
    )
    ns0 = fingerprint().dirname()  # where the scheduler plans: rank 0's namespace
    parent = save_now(w, save_job(IDS, [1, 2], text=b"p" * 2 * BLOCK, req="a", ns=ns0))
    child = save_job(IDS, [3], start=2 * BLOCK, parent=parent, text=b"p" * 3 * BLOCK, ns=ns0)
    big = save_job(IDS, [4, 5, 6, 7, 8, 9, 10], text=b"q" * 7 * BLOCK, req="b", ns=ns0)
    write, gate = w.store.write, threading.Event()

    def child_held(ns, sha1, *args, **kwargs):
        if sha1 == child.plan.sha1 and not gate.wait(WAIT):
            raise TimeoutError("the test never opened the gate")
        return write(ns, sha1, *args, **kwargs)

    w.store.write = child_held
    w.wait_for_save(StepMeta(saves=[child]))  # written when the gate opens
    w.wait_for_save(StepMeta(saves=[big]))  # needs the parent's room: it must not get it
    reports = []
    for _ in range(WAIT * 10):  # until the big save ended (the delta waits at the gate)
        reports.append(w.build_connector_worker_meta())
        ended = [e.sha1 for r in reports if r for e in r.written]
        ended += [sha1 for r in reports if r for _, sha1 in r.failed_saves]
        if big.plan.sha1 in ended:
            break
        threading.Event().wait(0.1)
    gate.set()
    w.drain()
    report = WorkerReport()
    for r in [*reports, w.build_connector_worker_meta()]:
        report.aggregate(r)
    assert [e.sha1 for e in report.written] == [child.plan.sha1]
    assert [sha1 for _, sha1 in report.failed_saves] == [big.plan.sha1]  # no room: skipped
