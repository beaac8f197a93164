"""The worker's restore path, on CPU tensors shaped like vLLM's CPU KV cache.

The engine tests cover restores end to end; these pin down the two read schemes of a
host-resident cache (several threads on a cached file, one sequential stream on a cold
one), partial restores behind a device hit, scattered target blocks, and a corrupt layer.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from vllm_kvdisk import format as fmt
from vllm_kvdisk import worker as worker_mod
from vllm_kvdisk.config import load_config
from vllm_kvdisk.format import Reason
from vllm_kvdisk.jobs import LoadFile, LoadJob, SaveJob, Scope, StepMeta
from vllm_kvdisk.keys import Fingerprint
from vllm_kvdisk.worker import WorkerSide

BLOCK = 16
LAYERS = 4
BLOCKS = 64
FILE_BLOCKS = 8


@pytest.fixture
def side(tmp_path):
    torch.manual_seed(0)
    layers = {f"model.layers.{i}.attn": torch.rand(BLOCKS, 2, BLOCK, 8) for i in range(LAYERS)}
    cfg = load_config({"kv_disk_dir": str(tmp_path), "kv_disk_min_free_mb": 0,
                       "kv_disk_io_threads": 3})
    fp = Fingerprint("m", "0", "float32", "cpu:test/1", BLOCK, 1, 0)
    w = WorkerSide(cfg, fp, BLOCK)
    w.register(layers)
    yield w, list(layers.values()), fp.dirname()
    w.shutdown()


def save(w: WorkerSide, blocks: list[int]) -> str:
    tokens = len(blocks) * BLOCK
    text = b"t" * tokens
    sha1 = hashlib.sha1(text).hexdigest()
    ids = np.arange(tokens, dtype="<u4").tobytes()
    w.copy_out_and_save(StepMeta(saves=[SaveJob("r", Scope(), sha1, tokens, None, 0, Reason.COLD,
                                                blocks, text, ids, 4096)]))
    fut = w._inflight.get(sha1)
    if fut is not None and not fut.result():
        raise AssertionError("save failed")
    return sha1


def restore(w, sha1, start_block, targets):
    job = LoadJob("r", Scope(), [LoadFile(sha1, FILE_BLOCKS * BLOCK, 0)], start_block, targets)
    return w._load(job)


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache-parallel", "cold-sequential"])
def test_restore_into_scattered_blocks_is_byte_identical(side, monkeypatch, cached):
    w, layers, _ = side
    src = list(range(FILE_BLOCKS))
    sha1 = save(w, src)
    calls = []
    real = fmt.pages_cached

    def decide(fd, meta):
        calls.append(real(fd, meta))
        return cached

    monkeypatch.setattr(worker_mod, "pages_cached", decide)
    targets = [40, 41, 42, 17, 18, 60, 33, 34]  # runs of 3, 2, 1, 2 blocks
    before = [t.clone() for t in layers]
    assert restore(w, sha1, 0, targets) == []
    assert calls == [True]  # the file was just written: its pages are in the page cache
    for t, old in zip(layers, before):
        assert torch.equal(t[targets], t[src])  # byte-equal pages
        untouched = [b for b in range(BLOCKS) if b not in targets]
        assert torch.equal(t[untouched], old[untouched])


def test_staged_restore_for_a_cache_outside_host_memory(side):
    """A device cache (GPU) is read into host staging and copied with torch; on the CPU the
    same path runs when the mover is told the cache is not host-resident."""
    w, layers, _ = side
    src = list(range(FILE_BLOCKS))
    sha1 = save(w, src)
    w.mover._host = None
    assert not w.mover.host_resident
    targets = [9, 13, 14, 15, 30, 31, 12, 50]
    assert restore(w, sha1, 0, targets) == []
    for t in layers:
        assert torch.equal(t[targets], t[src])
    out = [np.empty(len(targets) * w.mover.page_bytes, dtype=np.uint8) for _ in layers]
    w.mover.gather(targets, out)  # the torch gather path
    for t, got in zip(layers, out):
        assert got.tobytes() == t[src].numpy().tobytes()


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache-parallel", "cold-sequential"])
def test_partial_restore_behind_a_device_hit_leaves_the_local_blocks_alone(side, monkeypatch,
                                                                           cached):
    w, layers, _ = side
    monkeypatch.setattr(worker_mod, "pages_cached", lambda fd, meta: cached)
    sha1 = save(w, list(range(FILE_BLOCKS)))
    before = [t.clone() for t in layers]
    # The device already holds the first 3 blocks; only blocks 3.. are read into 50..54.
    targets = [50, 51, 52, 53, 54]
    assert restore(w, sha1, 3, targets) == []
    for t, old in zip(layers, before):
        assert torch.equal(t[targets], t[3:FILE_BLOCKS])
        assert torch.equal(t[:50], old[:50]) and torch.equal(t[55:], old[55:])


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache-parallel", "cold-sequential"])
def test_corrupt_layer_reports_every_block_bad_and_quarantines(side, monkeypatch, cached):
    w, _, ns = side
    monkeypatch.setattr(worker_mod, "pages_cached", lambda fd, meta: cached)
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
    assert restore(w, sha1, 0, targets) == targets
    assert not os.path.exists(path)
    qdir = os.path.join(w.store.root, "quarantine")
    assert any(name.startswith(f"{ns}-{sha1}") for name in os.listdir(qdir))


def test_pages_cached_probe(side, monkeypatch):
    w, _, ns = side
    sha1 = save(w, list(range(FILE_BLOCKS)))
    path = w.store.path(ns, sha1)
    fd = os.open(path, os.O_RDONLY)
    try:
        meta = fmt.read_meta(fd, os.fstat(fd).st_size)
        assert fmt.pages_cached(fd, meta)  # just written

        def not_resident(*args):
            raise BlockingIOError(11, "would block")

        monkeypatch.setattr(fmt.os, "preadv", not_resident)
        assert not fmt.pages_cached(fd, meta)
    finally:
        os.close(fd)


def test_block_runs_merge_consecutive_blocks(side):
    w, layers, _ = side
    assert w.mover.block_runs([5, 6, 7, 2, 9, 10]) == [(5, 3), (2, 1), (9, 2)]
    runs = w.mover.host_views(0, w.mover.block_runs([5, 6, 7, 2, 9, 10]))
    page = w.mover.page_bytes
    assert [v.nbytes for v in runs] == [3 * page, page, 2 * page]
    assert bytes(runs[1]) == layers[0][2].numpy().tobytes()
    with pytest.raises(ValueError):
        w.mover.block_runs([BLOCKS])


@pytest.mark.parametrize("us,expected", [(700, 0.0007), (0, 0.005), (9000, 0.005)])
def test_worker_shortens_the_gil_switch_interval(tmp_path, us, expected):
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        cfg = load_config({"kv_disk_dir": str(tmp_path), "kv_disk_gil_switch_us": us})
        w = WorkerSide(cfg, Fingerprint("m", "0", "float32", "cpu:test/1", BLOCK, 1, 0), BLOCK)
        w.register({"l0": torch.zeros(4, 2, BLOCK, 8)})
        w.shutdown()
        assert sys.getswitchinterval() == pytest.approx(expected)  # never lengthened
    finally:
        sys.setswitchinterval(before)
