"""Restore and save bandwidth of the worker's I/O path against the storage limit.

    .venv/bin/python benchmarks/io_bench.py [--tokens 4096] [--layers 16] [--kv-heads 8]

No engine: a KV cache tensor shaped like vLLM's (per layer [blocks, heads, 128, 2*head])
is filled with random pages, saved through the worker's save path, and restored through
its load path; each is timed against the same bytes moved by plain system calls in the
same run:
  * restore (page cache warm)  vs  os.preadv of the file into a preallocated buffer
  * restore (cold: file dropped from the page cache with posix_fadvise)  vs  cold preadv
  * save (encode + write + fsync + rename)  vs  os.writev of the same bytes + fsync
Ratios near 1.0 mean the path runs at the storage limit.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

from vllm_kvdisk.config import load_config
from vllm_kvdisk.format import Reason
from vllm_kvdisk.jobs import LoadFile, LoadJob, SaveJob, Scope, StepMeta
from vllm_kvdisk.keys import Fingerprint
from vllm_kvdisk.worker import WorkerSide

BLOCK = 128


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_read(path: str, buf: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        done = 0
        while done < size:
            got = os.preadv(fd, [buf[done:size]], done)
            if got <= 0:
                break
            done += got
        return done
    finally:
        os.close(fd)


def raw_write(directory: str, data: list[memoryview], i: int) -> None:
    # A new file each time, kept like a checkpoint is (deleting it right after the fsync
    # lets the file system skip work and flatters the baseline about 4x here).
    path = os.path.join(directory, f"raw-{i}.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in data:
            view = chunk
            while view.nbytes:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    blocks = args.tokens // BLOCK
    root = tempfile.mkdtemp(prefix="kvdisk-io-", dir=os.environ.get("KVDISK_BENCH_DIR"))
    try:
        shape = (blocks * 2, args.kv_heads, BLOCK, 2 * args.head_dim)
        layers = {f"model.layers.{i}.self_attn.attn": torch.rand(shape) for i in range(args.layers)}
        cfg = load_config({"kv_disk_dir": root, "kv_disk_io_threads": args.threads,
                           "kv_disk_min_free_mb": 0})
        fp = Fingerprint("bench", "0", "float32", "cpu:LBHNC/bench", BLOCK, 1, 0)
        worker = WorkerSide(cfg, fp, BLOCK)
        worker.register(layers)
        ns = fp.dirname()
        src = list(range(blocks))
        ids = np.arange(args.tokens, dtype="<u4") % 4000
        kv_bytes = sum(t[:blocks].numel() * 4 for t in layers.values())

        def save_once(i: int) -> str:
            text = f"checkpoint {i} ".encode() + b"x" * args.tokens
            sha1 = hashlib.sha1(text).hexdigest()
            job = SaveJob("r", Scope(), sha1, args.tokens, None, 0, Reason.COLD, src,
                          text, ids.tobytes(), 8192)
            worker.copy_out_and_save(StepMeta(saves=[job]))
            worker._inflight[sha1].result() if sha1 in worker._inflight else None
            return sha1

        counter = iter(range(10**6))
        save_s = median_time(lambda: save_once(next(counter)), args.repeat)
        sha1 = save_once(next(counter))
        path = worker.store.path(ns, sha1)
        size = os.path.getsize(path)
        pages = [memoryview(t[:blocks].numpy()).cast("B") for t in layers.values()]
        raw_dir = os.path.join(root, "raw")
        os.makedirs(raw_dir)
        write_s = median_time(lambda: raw_write(raw_dir, pages, next(counter)), args.repeat)

        target = list(range(blocks, 2 * blocks))
        job = LoadJob("r", Scope(), [LoadFile(sha1, args.tokens, 0)], 0, target)
        buf = memoryview(bytearray(size))
        raw_warm = median_time(lambda: raw_read(path, buf), args.repeat)
        load_warm = median_time(lambda: worker._load(job), args.repeat)

        def cold(fn):
            def run():
                drop_cache(path)
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0
            return statistics.median(run() for _ in range(args.repeat))

        raw_cold = cold(lambda: raw_read(path, buf))
        load_cold = cold(lambda: worker._load(job))
        for i, t in enumerate(layers.values()):  # the restore put the right bytes back
            if not torch.equal(t[blocks:], t[:blocks]):
                raise SystemExit(f"restore mismatch in layer {i}")
        worker.shutdown()
        gb = size / 1e9
        print(f"checkpoint: {args.tokens} tokens, {args.layers} layers, {kv_bytes / 1e6:.0f} MB "
              f"of KV, file {size / 1e6:.0f} MB, {args.threads} I/O threads")
        print(f"restore, page cache : {load_warm * 1e3:7.1f} ms {gb / load_warm:6.2f} GB/s | "
              f"raw preadv {raw_warm * 1e3:7.1f} ms {gb / raw_warm:6.2f} GB/s | "
              f"ratio {raw_warm / load_warm:.2f}")
        print(f"restore, cold       : {load_cold * 1e3:7.1f} ms {gb / load_cold:6.2f} GB/s | "
              f"raw preadv {raw_cold * 1e3:7.1f} ms {gb / raw_cold:6.2f} GB/s | "
              f"ratio {raw_cold / load_cold:.2f}")
        print(f"save (write+fsync)  : {save_s * 1e3:7.1f} ms {gb / save_s:6.2f} GB/s | "
              f"raw writev+fsync {write_s * 1e3:7.1f} ms {gb / write_s:6.2f} GB/s | "
              f"ratio {write_s / save_s:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
