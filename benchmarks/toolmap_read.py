"""Reading a large tool-call log at start-up: the windowed reader against the one before.

    .venv/bin/python benchmarks/toolmap_read.py [--sizes 64,128,256]

A log may hold ~100k records before compaction (2.6 KB each here: a call's text and its
sampled ids). The reader before grew one ``bytes`` by 1 MiB chunks, copying everything
read so far at each step: quadratic CPU, twice the log in memory, all of it holding the
API server's GIL. Both readers run side by side on the same file (in the page cache);
CPU seconds and the peak of Python allocations (tracemalloc, a separate pass) per size.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import tracemalloc

from vllm_kvdisk.replay.log import READ_CHUNK, ToolCall, encode_record, read_records, scan_records


def reader_before(fd: int, size: int, scope: str) -> int:
    """The reader before this change (``buf += chunk``), then the same scan."""
    buf = b""
    while len(buf) < size:
        chunk = os.pread(fd, min(READ_CHUNK, size - len(buf)), len(buf))
        if not chunk:
            break
        buf += chunk
    return len(scan_records(buf, scope).calls)


def reader_now(fd: int, size: int, scope: str) -> int:
    return len(read_records(fd, 0, size, scope).calls)


def write_log(path: str, mib: int) -> tuple[int, int]:
    record = encode_record(
        "bench",
        ToolCall(
            ("chatcmpl-tool-0123456789abcdef",),
            "<tool_call>" + "x" * 1500 + "</tool_call>",
            tuple(range(1000, 1250)),
        ),
    )
    count = (mib << 20) // len(record)
    with open(path, "wb") as fh:
        fh.write(record * count)
    return count, os.path.getsize(path)


def measure(fn, path: str, size: int) -> tuple[float, int, int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.process_time()
        n = fn(fd, size, "bench")
        cpu = time.process_time() - t0
        tracemalloc.start()
        fn(fd, size, "another model")  # peak of the read itself: no call is kept
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        os.close(fd)
    return cpu, peak, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,128,256", help="log sizes in MiB")
    args = ap.parse_args()
    print(
        f"{'MiB':>5} {'records':>8} {'before s':>9} {'now s':>7} {'ratio':>6} "
        f"{'before peak MiB':>16} {'now peak MiB':>13}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for mib in (int(s) for s in args.sizes.split(",")):
            path = os.path.join(tmp, "log.ktl")
            count, size = write_log(path, mib)
            now_s, now_peak, n_now = measure(reader_now, path, size)
            before_s, before_peak, n_before = measure(reader_before, path, size)
            if n_now != count or n_before != count:
                raise SystemExit(f"readers disagree: {n_now} / {n_before} of {count}")
            print(
                f"{mib:>5} {count:>8} {before_s:>9.2f} {now_s:>7.2f} "
                f"{before_s / now_s:>6.1f} {before_peak / 2**20:>16.0f} "
                f"{now_peak / 2**20:>13.1f}"
            )
            os.unlink(path)


if __name__ == "__main__":
    main()
