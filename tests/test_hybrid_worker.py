"""A hybrid model's worker half on host tensors, without an engine: a save stores each
group's own blocks (the window before the file's end, the full group's delta), the engine
is held before its next forward only until the window pages are copied, and a restore
puts each group's pages into that group's blocks, byte for byte."""

import threading

import numpy as np
import pytest
import torch
from workers import BLOCK, load_job, make_worker, save, save_job

from vllm_kvdisk.connector.jobs import LoadFile, StepMeta
from vllm_kvdisk.core.compat import Placement
from vllm_kvdisk.core.format import Group, GroupKind

BLOCKS, WINDOW = 40, 40  # a hit needs tokens hit-39..: 3 blocks of 16
GROUPS = (Group(GroupKind.WINDOW, 2, WINDOW), Group(GroupKind.FULL, 1))
NAMES = (("w0", "w1"), ("f0",))


@pytest.fixture
def hybrid(tmp_path):
    made = []

    def make(name="kv"):
        torch.manual_seed(0)
        # the groups' layers alias one buffer, as vLLM lays them out: never de-duplicated
        shared = torch.rand(BLOCKS, 2, BLOCK, 8)
        caches = {"w0": shared, "w1": torch.rand(BLOCKS, 2, BLOCK, 8), "f0": shared}
        place = Placement(
            layer_names=tuple(n for g in NAMES for n in g),
            num_blocks=BLOCKS,
            groups=GROUPS,
            group_layers=NAMES,
        )
        w = make_worker(tmp_path, caches, placement=place, name=name, kv_disk_io_threads=2)
        made.append(w)
        return w, caches

    yield make
    for w in made:
        w.shutdown()


def test_save_copies_window_pages_first_and_restores_each_group(hybrid):
    w, caches = hybrid()
    ids = np.arange(160, dtype="<u4")
    # request blocks 0..9 (160 tokens): window group table, full group table
    window_table = list(range(10, 20))
    full_table = list(range(20, 30))
    job = save_job(ids, full_table)
    job.groups = [window_table[7:10], full_table]  # the window before 160: blocks 7..9
    gate_open, full_started = threading.Event(), threading.Event()
    gather_layers = w.mover.gather_layers

    def gated(block_ids, out, after=None, layers=None):
        if layers == [2]:  # the full-attention layer: held until the test lets it go
            full_started.set()
            assert gate_open.wait(30)
        return gather_layers(block_ids, out, after, layers)

    w.mover.gather_layers = gated
    w.wait_for_save(StepMeta(saves=[job]))
    assert full_started.wait(30)
    # the next step may free window blocks: the engine waits for their pages only
    step = threading.Thread(target=w.handle_preemptions, args=(StepMeta(),), daemon=True)
    step.start()
    step.join(10)
    returned = not step.is_alive()
    gate_open.set()
    assert returned, "the next step waited for the full-attention pages' copy too"
    w.drain()
    report = w.build_connector_worker_meta()
    assert [e.sha1 for e in report.written] == [job.plan.sha1]
    w.mover.gather_layers = gather_layers

    # A restart's engine gives other blocks: window blocks below the hit's window are
    # vLLM's null block (0), never written.
    w2, caches2 = hybrid("kv")
    before = {name: t.clone() for name, t in caches2.items()}
    new_window = [0] * 7 + [31, 32, 33]
    new_full = list(range(1, 11))
    load = load_job(
        ids, [LoadFile(job.plan.sha1, 0, 160, 160, ranges=((7, 10), (0, 10)))], 0, new_full
    )
    load.groups = [new_window, new_full]
    w2.start_load_kv(StepMeta(loads=[load]))
    w2.loads.pending["r"][0].result(timeout=30)
    assert w2.loads.pending["r"][0].result() == []  # nothing to recompute
    for name in ("w0", "w1"):
        assert torch.equal(caches2[name][[31, 32, 33]], caches[name][[17, 18, 19]])
    assert torch.equal(caches2["f0"][new_full], caches["f0"][full_table])
    untouched = [b for b in range(BLOCKS) if b not in new_full + [31, 32, 33]]
    assert torch.equal(caches2["w1"][untouched], before["w1"][untouched])
    assert torch.equal(caches2["w0"][0], before["w0"][0])  # the null block


def test_a_failed_load_on_a_hybrid_model_is_reported_per_request(hybrid):
    w, _ = hybrid()
    ids = np.arange(160, dtype="<u4")
    load = load_job(
        ids, [LoadFile("0" * 40, 0, 160, 160, ranges=((7, 10), (0, 10)))], 0, list(range(1, 11))
    )
    load.groups = [[0] * 7 + [31, 32, 33], list(range(1, 11))]
    w.start_load_kv(StepMeta(loads=[load]))
    w.loads.pending["r"][0].result(timeout=30)
    sending, recving = w.get_finished(set())
    assert recving == {"r"}
    assert w.take_failed_recving() == {"r"}  # not block ids: vLLM cannot map them back
    assert w.get_block_ids_with_load_errors() == set()


def test_one_group_unchanged(tmp_path):
    """A single full-attention group keeps block-level load errors (vLLM recomputes only
    the blocks lost)."""
    caches = {"l0": torch.rand(8, 2, BLOCK, 8)}
    w = make_worker(tmp_path, caches)
    try:
        ids = np.arange(64, dtype="<u4")
        load = load_job(ids, [LoadFile("0" * 40, 0, 64, 64)], 0, [1, 2, 3, 4])
        w.start_load_kv(StepMeta(loads=[load]))
        w.loads.pending["r"][0].result(timeout=30)
        w.get_finished(set())
        assert w.take_failed_recving() == set()
        assert w.get_block_ids_with_load_errors() == {1, 2, 3, 4}
        assert save(w, save_job(ids, [4, 5, 6, 7]))  # one group: no group block lists
    finally:
        w.shutdown()
