"""Page gather/scatter bandwidth of the connector's transfer path vs a plain device copy.

    .venv/bin/python benchmarks/transfer_bench.py [--blocks 64] [--layers 16]

Uses the same PageMover and StagingPool the worker uses. Before timing, each device's
copies are checked (the process exits 1 if one fails): pages gathered from scattered
blocks and scattered back are byte-identical; on a GPU a gather ordered after a mark()
sees what a long "forward" on the compute stream wrote just before the mark (the side
stream waits on its event), and a copy's device temporary stays within
DEVICE_TRANSIENT_BYTES. Needs only torch and numpy (no vLLM): on a CUDA machine run
``PYTHONPATH=. python benchmarks/transfer_bench.py``. On the CPU it times gathering
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


def check(device: str) -> list[str]:
    """The copies' correctness on ``device`` (the torch path, as a GPU runs it); returns
    what failed."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_kvdisk.connector import transfer

    failed = []
    torch.manual_seed(0)
    # 1 MiB pages, 256 blocks per layer: a 64-block copy is 64 MiB, 4 pieces of 16 MiB.
    layers = [torch.rand(256, 2, 64, 2048, device=device) for _ in range(2)]
    mover = PageMover(layers, 64, f"{device}:check", host_copies=False)
    ids = sorted(np.random.default_rng(1).choice(256, 64, replace=False).tolist(), key=lambda i: -i)
    out = [pinned_buffer(len(ids) * mover.page_bytes) for _ in layers]  # plain on a CPU
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    mover.gather(ids, out)
    if device == "cuda":
        extra = torch.cuda.max_memory_allocated() - base
        if extra > transfer.DEVICE_TRANSIENT_BYTES + (1 << 20):
            failed.append(
                f"gather took {extra >> 20} MiB of device memory (cap "
                f"{transfer.DEVICE_TRANSIENT_BYTES >> 20} MiB)"
            )
    want = [t[ids].contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in layers]
    if [o.tobytes() for o in out] != want:
        failed.append("gathered pages differ from the blocks")
    back = list(reversed(ids))
    for i, o in enumerate(out):
        mover.scatter(i, back, o)
    if any(
        t[back].contiguous().view(torch.uint8).cpu().numpy().tobytes() != w
        for t, w in zip(layers, want)
    ):
        failed.append("scattered pages differ from the pages given")
    if device == "cuda":
        # A "forward": long work on the compute stream, then the write a save must see.
        for _ in range(50):
            layers[0].mul_(1.0)
        layers[0][ids] = 7.0
        after = mover.mark()  # the engine thread, right after the forward is queued
        with ThreadPoolExecutor(1) as pool:
            pool.submit(mover.gather, ids, out, after).result()
        if not (np.frombuffer(out[0], dtype=np.float32) == 7.0).all():
            failed.append("a gather after mark() did not see the forward's writes")
    checked = (
        "gather, scatter, stream order and device memory"
        if device == "cuda"
        else "gather and scatter (stream order and device memory: on a GPU only)"
    )
    print(f"check {device}: " + ("FAILED: " + "; ".join(failed) if failed else f"{checked} ok"))
    return failed


def run(device: str, args: argparse.Namespace) -> None:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    total = args.blocks * 4  # the cache holds 4x the request's blocks; ids are scattered
    shape = (total, args.kv_heads, 128, 2 * args.head_dim)
    layers = [torch.rand(shape, device=device) for _ in range(args.layers)]
    mover = PageMover(layers, 128, f"{device}:bench")
    rng = np.random.default_rng(0)
    ids = sorted(rng.choice(total, args.blocks, replace=False).tolist())
    pool = (
        StagingPool(1 << 34, allocate=pinned_buffer) if device == "cuda" else StagingPool(1 << 34)
    )
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
    print(
        f"{device}: {args.layers} layers x {args.blocks} blocks = {moved / 1e6:.0f} MB | "
        f"gather {moved / gather / 1e9:.2f} GB/s | scatter {moved / scatter_s / 1e9:.2f} GB/s | "
        f"plain copy {moved / plain / 1e9:.2f} GB/s | gather/plain {plain / gather:.2f}, "
        f"scatter/plain {plain / scatter_s:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    failed = check("cpu")
    run("cpu", args)
    if torch.cuda.is_available():
        failed += check("cuda")
        run("cuda", args)
    else:
        print("cuda: not available on this machine (the GPU path is untested here)")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
