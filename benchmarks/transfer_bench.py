"""Page gather/scatter bandwidth of the connector's transfer path vs a plain device copy.

    .venv/bin/python benchmarks/transfer_bench.py [--blocks 64] [--layers 16]

Uses the same PageMover and StagingPool the worker uses. On the CPU it times gathering
a request's blocks of every layer into reused host buffers and scattering them back,
against one contiguous tensor copy of the same bytes; where CUDA is present it also runs
with the KV cache on the GPU (host side: pinned staging buffers, as the worker
allocates them for a GPU; copies on a side stream). Prints GB/s
and the ratio to the plain copy. (Saves gather on every backend; restores scatter only
into a device cache: a host-resident CPU cache is read straight into its blocks, see
io_bench.py.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from vllm_kvdisk.connector.staging import StagingPool
from vllm_kvdisk.connector.transfer import PageMover, pinned_buffer


def timed(fn, repeat: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(device: str, args: argparse.Namespace) -> None:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    total = args.blocks * 4  # the cache holds 4x the request's blocks; ids are scattered
    shape = (total, args.kv_heads, 128, 2 * args.head_dim)
    layers = [torch.rand(shape, device=device) for _ in range(args.layers)]
    mover = PageMover(layers, 128, f"{device}:bench")
    rng = np.random.default_rng(0)
    ids = sorted(rng.choice(total, args.blocks, replace=False).tolist())
    pool = StagingPool(1 << 34, allocate=pinned_buffer) if device == "cuda" else StagingPool(1 << 34)
    nbytes = args.blocks * mover.page_bytes
    bufs = [pool.get(nbytes) for _ in range(args.layers)]
    moved = nbytes * args.layers
    gather = timed(lambda: mover.gather(ids, bufs), args.repeat, sync)

    def scatter() -> None:
        for i, buf in enumerate(bufs):
            mover.scatter(i, ids, buf)

    scatter_s = timed(scatter, args.repeat, sync)
    src = torch.rand(moved // 4, device=device)
    dst = torch.empty_like(src)
    plain = timed(lambda: dst.copy_(src), args.repeat, sync)
    if device == "cuda":
        host = torch.empty(moved // 4, pin_memory=True)
        d2h = timed(lambda: host.copy_(src, non_blocking=True), args.repeat, sync)
        print(f"cuda: pinned device->host copy {moved / d2h / 1e9:.1f} GB/s")
    print(f"{device}: {args.layers} layers x {args.blocks} blocks = {moved / 1e6:.0f} MB | "
          f"gather {moved / gather / 1e9:.2f} GB/s | scatter {moved / scatter_s / 1e9:.2f} GB/s | "
          f"plain copy {moved / plain / 1e9:.2f} GB/s | gather/plain {plain / gather:.2f}, "
          f"scatter/plain {plain / scatter_s:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    run("cpu", args)
    if torch.cuda.is_available():
        run("cuda", args)
    else:
        print("cuda: not available on this machine (the GPU path is untested here)")


if __name__ == "__main__":
    main()
