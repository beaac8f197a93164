"""The worker's save and restore paths, on CPU tensors shaped like vLLM's KV caches.

The engine tests cover restores end to end; these pin down the read schemes of a
host-resident cache (several threads on a cached file, one sequential stream on a cold
one), chains of many files, files used partway, partial restores behind a device hit,
scattered target blocks, corrupt and stale files, and the staged page path GPUs use,
under every KV cache layout vLLM defines (strided per-layer views, as vLLM hands them).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import workers
from workers import BLOCK, FP, load_job, make_worker, save_job

from vllm_kvdisk.connector import restore as restore_mod
from vllm_kvdisk.connector.jobs import LoadFile, LoadJob, Scope, StepMeta
from vllm_kvdisk.connector.worker import WorkerSide
from vllm_kvdisk.core.config import load_config
from vllm_kvdisk.core.keys import Fingerprint
from vllm_kvdisk.storage import fileread as fmt
from vllm_kvdisk.storage import pageread

LAYERS = 4
BLOCKS = 64
FILE_BLOCKS = 8


@pytest.fixture
def side(tmp_path):
    torch.manual_seed(0)
    layers = {f"model.layers.{i}.attn": torch.rand(BLOCKS, 2, BLOCK, 8) for i in range(LAYERS)}
    w = make_worker(tmp_path, layers)
    yield w, list(layers.values()), FP.dirname()
    w.shutdown()


IDS = np.arange(10_000, 10_000 + BLOCKS * BLOCK, dtype="<u4")


def save(w: WorkerSide, blocks: list[int], start: int = 0, parent: str | None = None) -> str:
    """Save request blocks [start/BLOCK, ...) held in engine blocks ``blocks``."""
    return workers.save(w, save_job(IDS, blocks, start=start, parent=parent))


def load(w, files, start_block, targets, ids=IDS):
    return w.loads.load(load_job(ids, files, start_block, targets))


def whole(sha1, start, end):
    return LoadFile(sha1, start, end, end)


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache-parallel", "cold-sequential"])
def test_restore_into_scattered_blocks_is_byte_identical(side, monkeypatch, cached):
    w, layers, _ = side
    src = list(range(FILE_BLOCKS))
    sha1 = save(w, src)
    calls = []
    real = pageread.pages_cached

    def decide(fd, meta):
        calls.append(real(fd, meta))
        return cached

    monkeypatch.setattr(restore_mod, "pages_cached", decide)
    targets = [40, 41, 42, 17, 18, 60, 33, 34]  # runs of 3, 2, 1, 2 blocks
    before = [t.clone() for t in layers]
    assert load(w, [whole(sha1, 0, FILE_BLOCKS * BLOCK)], 0, targets) == []
    assert calls == [True]  # the file was just written: its pages are in the page cache
    for t, old in zip(layers, before):
        assert torch.equal(t[targets], t[src])  # byte-equal pages
        untouched = [b for b in range(BLOCKS) if b not in targets]
        assert torch.equal(t[untouched], old[untouched])


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache-parallel", "cold-sequential"])
def test_a_deep_chain_and_a_last_file_used_partway(side, monkeypatch, cached):
    """Twelve files of two blocks each, the last one used for one of its two blocks (the
    prompt leaves it there): every page lands where it belongs, the rest is untouched."""
    w, layers, _ = side
    monkeypatch.setattr(restore_mod, "pages_cached", lambda fd, meta: cached)
    files, parent = [], None
    for i in range(12):
        sha1 = save(w, [2 * i, 2 * i + 1], start=2 * i * BLOCK, parent=parent)
        files.append(whole(sha1, 2 * i * BLOCK, (2 * i + 2) * BLOCK))
        parent = sha1
    files[-1] = LoadFile(files[-1].sha1, files[-1].start, files[-1].start + BLOCK, files[-1].tokens)
    targets = list(range(63, 63 - 23, -1))  # 23 blocks, in reverse order
    before = [t.clone() for t in layers]
    assert load(w, files, 0, targets) == []
    for t, old in zip(layers, before):
        assert torch.equal(t[targets], old[list(range(23))])
        assert torch.equal(t[:40], old[:40])


def test_staged_restore_for_a_cache_outside_host_memory(side):
    """A device cache (GPU) is read into host staging and copied with torch; on the CPU the
    same path runs when the mover is told the cache is not host-resident."""
    w, layers, _ = side
    src = list(range(FILE_BLOCKS))
    sha1 = save(w, src)
    w.mover._host = None
    assert not w.mover.host_resident
    targets = [9, 13, 14, 15, 30, 31, 12, 50]
    assert load(w, [whole(sha1, 0, FILE_BLOCKS * BLOCK)], 0, targets) == []
    for t in layers:
        assert torch.equal(t[targets], t[src])
    out = [np.empty(len(targets) * w.mover.page_bytes, dtype=np.uint8) for _ in layers]
    w.mover.gather(targets, out)  # the torch gather path
    for t, got in zip(layers, out):
        assert got.tobytes() == t[src].numpy().tobytes()


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache-parallel", "cold-sequential"])
def test_partial_restore_behind_a_device_hit_leaves_the_local_blocks_alone(
    side, monkeypatch, cached
):
    w, layers, _ = side
    monkeypatch.setattr(restore_mod, "pages_cached", lambda fd, meta: cached)
    sha1 = save(w, list(range(FILE_BLOCKS)))
    before = [t.clone() for t in layers]
    # The device already holds the first 3 blocks; only blocks 3.. are read into 50..54.
    targets = [50, 51, 52, 53, 54]
    assert load(w, [whole(sha1, 0, FILE_BLOCKS * BLOCK)], 3, targets) == []
    for t, old in zip(layers, before):
        assert torch.equal(t[targets], t[3:FILE_BLOCKS])
        assert torch.equal(t[:50], old[:50]) and torch.equal(t[55:], old[55:])


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache-parallel", "cold-sequential"])
def test_corrupt_layer_reports_every_block_bad_and_quarantines(side, monkeypatch, cached):
    w, _, ns = side
    monkeypatch.setattr(restore_mod, "pages_cached", lambda fd, meta: cached)
    sha1 = save(w, list(range(FILE_BLOCKS)))
    path = w.store.path(ns, sha1)
    with open(path, "rb") as f:
        meta = fmt.read_meta(f.fileno(), os.path.getsize(path))
    with open(path, "r+b") as f:  # flip one byte in the last layer
        at = meta.offsets.layer(LAYERS - 1) + 5
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    targets = list(range(20, 28))
    assert load(w, [whole(sha1, 0, FILE_BLOCKS * BLOCK)], 0, targets) == targets
    assert not os.path.exists(path)
    qdir = os.path.join(w.store.root, "quarantine")
    assert any(name.startswith(f"{ns}-{sha1}") for name in os.listdir(qdir))


def test_a_file_with_other_token_ids_is_a_miss_not_a_quarantine(side):
    """The file is sound but holds another prompt (a digest collision, or a file replaced
    by another replica): its blocks are recomputed and it stays on disk."""
    w, layers, ns = side
    sha1 = save(w, list(range(FILE_BLOCKS)))
    other = IDS.copy()
    other[5] += 1
    targets = list(range(20, 28))
    before = [t.clone() for t in layers]
    assert load(w, [whole(sha1, 0, FILE_BLOCKS * BLOCK)], 0, targets, ids=other) == targets
    assert os.path.exists(w.store.path(ns, sha1))
    assert all(torch.equal(t, old) for t, old in zip(layers, before))  # nothing was read in
    assert [(n, s) for n, s, _ in w.build_connector_worker_meta().stale] == [(ns, sha1)]


def test_a_failing_middle_file_keeps_the_blocks_before_it(side):
    w, layers, ns = side
    a = save(w, [0, 1])
    b = save(w, [2, 3], start=2 * BLOCK, parent=a)
    c = save(w, [4, 5], start=4 * BLOCK, parent=b)
    os.unlink(w.store.path(ns, b))
    targets = [30, 31, 32, 33, 34, 35]
    before = [t.clone() for t in layers]
    bad = load(w, [whole(a, 0, 32), whole(b, 32, 64), whole(c, 64, 96)], 0, targets)
    assert bad == [32, 33, 34, 35]
    for t, old in zip(layers, before):
        assert torch.equal(t[[30, 31]], old[[0, 1]])


def test_block_runs_merge_consecutive_blocks(side):
    w, layers, _ = side
    assert w.mover.block_runs([5, 6, 7, 2, 9, 10]) == [(5, 3), (2, 1), (9, 2)]
    runs = w.mover.host_views(0, w.mover.block_runs([5, 6, 7, 2, 9, 10]))
    page = w.mover.page_bytes
    assert [v.nbytes for v in runs] == [3 * page, page, 2 * page]
    assert bytes(runs[1]) == layers[0][2].numpy().tobytes()
    with pytest.raises(ValueError):
        w.mover.block_runs([BLOCKS])


def test_pages_cached_probe(side, monkeypatch):
    w, _, ns = side
    sha1 = save(w, list(range(FILE_BLOCKS)))
    path = w.store.path(ns, sha1)
    fd = os.open(path, os.O_RDONLY)
    try:
        meta = fmt.read_meta(fd, os.fstat(fd).st_size)
        assert pageread.pages_cached(fd, meta)  # just written

        def not_resident(*args):
            raise BlockingIOError(11, "would block")

        monkeypatch.setattr(fmt.os, "preadv", not_resident)
        assert not pageread.pages_cached(fd, meta)
    finally:
        os.close(fd)


def vllm_layer_views(layout_name: str, num_layers=3, num_blocks=12, heads=2, dtype=torch.float16):
    """The per-layer tensors vLLM hands ``register_kv_caches`` for a named layout: views
    into one shared buffer (vllm/v1/kv_cache_interface.py), strided for block-outer ones."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=8, dtype=dtype)
    per_block = num_layers * spec.page_size_bytes
    fixed = (None, per_block if layout.is_block_outermost else None, None, None, None)
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, num_layers, layout, fixed_strides=fixed
    )
    tensor = KVCacheTensor(
        size=per_block * num_blocks,
        layers=[f"l{i}" for i in range(num_layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return raw, {f"model.layers.{i}.attn": v for i, v in enumerate(views)}


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_every_vllm_kv_layout_round_trips_through_the_device_page_path(tmp_path, layout):
    """The GPU code path (torch gather/scatter, staged reads) on the CPU, for each layout's
    strided per-layer views: a page saved from blocks A restores byte-identical into B."""
    raw, views = vllm_layer_views(layout)
    raw.copy_(torch.randint(-128, 127, raw.shape, dtype=torch.int8))
    w = make_worker(tmp_path, views)
    try:
        w.mover._host = None  # the device path, whatever the tensors' contiguity
        layers = list(views.values())
        assert layers[0].is_contiguous() == (layout == "LBHNC")  # the others are strided
        src, dst = [1, 2, 3, 7], [11, 5, 9, 0]
        pages = [t[src].clone() for t in layers]
        sha1 = save(w, src)
        assert load(w, [whole(sha1, 0, 4 * BLOCK)], 0, dst) == []
        for t, want in zip(layers, pages):
            assert (
                t[dst].view(torch.uint8).numpy().tobytes()
                == want.view(torch.uint8).numpy().tobytes()
            )
        out = [np.empty(4 * w.mover.page_bytes, dtype=np.uint8) for _ in layers]
        w.mover.gather(dst, out)
        assert [o.tobytes() for o in out] == [
            p.contiguous().view(torch.uint8).numpy().tobytes() for p in pages
        ]
    finally:
        w.shutdown()


@pytest.mark.parametrize("us,expected", [(700, 0.0007), (0, 0.005), (9000, 0.005)])
def test_worker_shortens_the_gil_switch_interval(tmp_path, us, expected):
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        cfg = load_config({"kv_disk_dir": str(tmp_path), "kv_disk_gil_switch_us": us})
        w = WorkerSide(cfg, FP, BLOCK)
        w.register_kv_caches({"l0": torch.zeros(4, 2, BLOCK, 8)})
        w.shutdown()
        assert sys.getswitchinterval() == pytest.approx(expected)  # never lengthened
    finally:
        sys.setswitchinterval(before)


def test_every_tp_rank_restores_its_own_file_of_a_job_planned_from_rank_0s_index(tmp_path):
    """The scheduler plans from rank 0's namespace and sends the inodes it indexed there.
    Rank 1's file of the same checkpoint is another file (another inode) in its own
    namespace: it must load, not count as replaced; rank 0 still catches a replaced file."""
    torch.manual_seed(0)
    ranks = []
    for rank in (0, 1):
        fp = Fingerprint("m", "0", "float32", "cpu:test/1", BLOCK, 2, rank)
        layers = [torch.rand(BLOCKS, 1, BLOCK, 8) for _ in range(LAYERS)]
        cfg = load_config({"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_min_free_mb": 0})
        w = WorkerSide(cfg, fp, BLOCK)
        w.register_kv_caches({f"model.layers.{i}.attn": t for i, t in enumerate(layers)})
        ranks.append((w, layers, fp.dirname()))
    try:
        src, targets = list(range(FILE_BLOCKS)), list(range(40, 40 + FILE_BLOCKS))
        (sha1,) = {save(w, src) for w, _, _ in ranks}
        ns0 = ranks[0][2]
        inode0 = os.stat(ranks[0][0].store.path(ns0, sha1)).st_ino
        assert os.stat(ranks[1][0].store.path(ranks[1][2], sha1)).st_ino != inode0
        end = FILE_BLOCKS * BLOCK
        for w, layers, _ in ranks:
            job = LoadJob(
                "r",
                Scope(),
                [LoadFile(sha1, 0, end, end, inode0)],
                0,
                targets,
                IDS[:end].tobytes(),
                indexed_ns=ns0,
            )
            assert w.loads.load(job) == []
            for t in layers:
                assert torch.equal(t[targets], t[src])
        replaced = LoadJob(
            "r",
            Scope(),
            [LoadFile(sha1, 0, end, end, inode0 + 1)],
            0,
            targets,
            IDS[:end].tobytes(),
            indexed_ns=ns0,
        )
        assert ranks[0][0].loads.load(replaced) == targets
    finally:
        for w, _, _ in ranks:
            w.shutdown()


def test_a_step_that_computes_waits_for_no_load(side, monkeypatch):
    """A pending load may be waited on (briefly) only in a step that computes nothing.
    ``wait_for_save`` ends the step's timing before vLLM asks for the results, and the
    flag read there said "idle" in every step: each step decoding other requests could
    stall while someone's restore was in flight."""
    w, _, _ = side
    asked = []
    monkeypatch.setattr(w.loads, "finished", lambda idle: (asked.append(idle), set())[1])
    for tokens in (7, 0):
        w.bind_connector_metadata(StepMeta(step_tokens=tokens))
        w.wait_for_save(StepMeta(step_tokens=tokens))
        w.get_finished(set())
    assert asked == [False, True]
