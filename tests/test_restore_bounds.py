"""A restore's resources stay bounded whatever the chain or the file claims: descriptors
(a chain of any length restores completely under a low open-file limit) and memory (pages
a restore does not use are checksummed through a bounded scratch, on the host and the
device page paths)."""

from __future__ import annotations

import os
import resource

import numpy as np
import pytest
import torch
from workers import BLOCK, FP, make_worker, save_job

from vllm_kvdisk.connector import restore as restore_mod
from vllm_kvdisk.connector.jobs import LoadFile, LoadJob, Scope, StepMeta
from vllm_kvdisk.connector.worker import WorkerSide


def make(tmp_path, blocks: int) -> tuple[WorkerSide, list[torch.Tensor]]:
    torch.manual_seed(3)
    caches = {f"model.layers.{i}.attn": torch.rand(blocks, 1, BLOCK, 4) for i in range(2)}
    return make_worker(tmp_path, caches, kv_disk_io_threads=2), list(caches.values())


def save(w: WorkerSide, ids: np.ndarray, blocks: list[int], start: int, parent: str | None) -> str:
    """Hand a save to the worker without waiting for it (a text of its own per length)."""
    tokens = start + len(blocks) * BLOCK
    job = save_job(ids, blocks, start=start, parent=parent, text=b"%d:" % tokens + b"t" * tokens)
    w.wait_for_save(StepMeta(saves=[job]))
    return job.plan.sha1


def test_a_chain_longer_than_the_open_file_limit_restores_completely(tmp_path):
    """Every file of a chain used to be open at once: past the descriptor limit the load
    failed part-way and the rest was recomputed."""
    files = 1000
    w, layers = make(tmp_path, 2 * files)
    ids = np.arange(1, 1 + files * BLOCK, dtype="<u4")
    try:
        chain, parent = [], None
        for i in range(files):
            parent = save(w, ids, [i], i * BLOCK, parent)
            chain.append(LoadFile(parent, i * BLOCK, (i + 1) * BLOCK, (i + 1) * BLOCK))
            if i % 100 == 99:
                w.drain()  # keep the parents of the next saves on disk
        w.drain()
        targets = list(range(files, 2 * files))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        in_use = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 400, hard))
        try:
            out = w.loads.load(LoadJob("r", Scope(), chain, 0, targets, ids.tobytes()))
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert out == []
        for t in layers:
            assert torch.equal(t[files:], t[:files])
    finally:
        w.shutdown()


@pytest.mark.parametrize("device_path", [False, True], ids=["host-path", "device-path"])
def test_unused_pages_are_checksummed_through_a_bounded_scratch(tmp_path, monkeypatch, device_path):
    """A file used for 2 of its 12 blocks: the other 10 pages of each layer used to be read
    into one scratch of their whole size (a size-consistent hostile file could ask for any
    amount). Now no buffer is larger than the used pages or the scratch cap, and a flipped
    byte in an unused page is still caught by the layer's checksum."""
    w, layers = make(tmp_path, 32)
    ids = np.arange(1, 1 + 12 * BLOCK, dtype="<u4")
    page = w.mover.page_bytes
    monkeypatch.setattr(restore_mod, "SCRATCH_BYTES", page, raising=False)
    asked: list[int] = []
    real_get = w.staging.get
    monkeypatch.setattr(w.staging, "get", lambda n: asked.append(n) or real_get(n))
    if device_path:
        w.mover._host = None
    try:
        sha1 = save(w, ids, list(range(12)), 0, None)
        w.drain()
        asked.clear()
        job = LoadJob(
            "r",
            Scope(),
            [LoadFile(sha1, 0, 2 * BLOCK, 12 * BLOCK)],
            0,
            [20, 21],
            ids[: 2 * BLOCK].tobytes(),
        )
        assert w.loads.load(job) == []
        assert asked and max(asked) <= 2 * page  # the used pages, or one page of scratch
        for t in layers:
            assert torch.equal(t[[20, 21]], t[[0, 1]])
        path = tmp_path / "kv" / FP.dirname() / f"{sha1}.kv"
        data = bytearray(path.read_bytes())
        data[-page // 2] ^= 0xFF  # inside the last (unused) page of the last layer
        path.write_bytes(bytes(data))
        assert w.loads.load(job) == [20, 21]  # caught: the blocks are recomputed
        assert not path.exists()  # proven corrupt: quarantined
    finally:
        w.shutdown()
