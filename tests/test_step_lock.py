"""The engine's step never waits for ``ROOT/.lock``. A restore that proves a file corrupt
quarantines it under the lock on the load's own thread (``kvdisk-load``): while another
process holds the lock, the worker's step hooks return and the request is simply still
loading. Held by a real ``flock`` of another process; checked by what happened while it
was held (an Event marks the load thread at the lock), never by durations."""

from __future__ import annotations

import os
import threading

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
import workers  # noqa: E402
from workers import BLOCK, FP, load_job, make_worker, save_job  # noqa: E402

from vllm_kvdisk.connector.jobs import LoadFile, StepMeta  # noqa: E402
from vllm_kvdisk.storage import fileread  # noqa: E402
from vllm_kvdisk.storage.lock import DirLock  # noqa: E402
from vllm_kvdisk.testing.harness import hold_lock  # noqa: E402

IDS = np.arange(10_000, 10_000 + 64 * BLOCK, dtype="<u4")


def test_a_restores_quarantine_waits_on_the_load_thread_never_in_the_step(tmp_path, monkeypatch):
    layers = {f"model.layers.{i}.attn": torch.rand(64, 2, BLOCK, 8) for i in range(4)}
    w = make_worker(tmp_path, layers)
    try:
        sha1 = workers.save(w, save_job(IDS, list(range(8))))
        path = w.store.path(FP.dirname(), sha1)
        with open(path, "rb") as fh:
            meta = fileread.read_meta(fh.fileno(), os.path.getsize(path))
        with open(path, "r+b") as fh:  # one byte of the last layer flipped
            fh.seek(meta.offsets.layer(3) + 5)
            byte = fh.read(1)
            fh.seek(meta.offsets.layer(3) + 5)
            fh.write(bytes([byte[0] ^ 0xFF]))
        at_lock = threading.Event()
        real = DirLock.hold

        def hold(self, timeout_s=None):
            if threading.current_thread().name.startswith("kvdisk-load"):
                at_lock.set()
            return real(self, timeout_s)

        monkeypatch.setattr(DirLock, "hold", hold)
        targets = list(range(20, 28))
        job = load_job(IDS, [LoadFile(sha1, 0, 8 * BLOCK, 8 * BLOCK)], 0, targets)
        holder = hold_lock(w.store.root)
        try:
            w.start_load_kv(StepMeta(loads=[job]))  # the step hands the load to a thread
            assert at_lock.wait(60)  # the load thread waits for the lock now
            assert w.get_finished(set()) == (None, None)  # the step returns: still loading
            assert holder.poll() is None and os.path.exists(path)
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait()
        future, _ = w.loads.pending[job.req_id]
        assert future.result() == targets  # recomputed
        assert not os.path.exists(path)  # quarantined once the lock was free
    finally:
        w.shutdown()
