"""Lossless compression on disk (--kv-disk-compression): what it saves and what it costs,
compressed against raw, side by side in one run.

    .venv/bin/python benchmarks/compression_bench.py [--tokens 6000] [--skip-decode | --only-decode]

KV: real engine pages. A vLLM engine with kvdisk (compression off) prefills a prompt and
saves its checkpoints; their pages are read back and are the data of every measurement:
  * SmolLM2-135M-Instruct (benchmarks/prepare_smollm2.py), a real chat (this repository's
    docs as the user's message, the model's chat template), in bf16 and in fp32;
  * the wide random model of engine_bench (hidden 768, 8 layers), random ids, bf16 and fp32.
Each chain is encoded again twice, raw and compressed (``encode_plan`` of the same plans),
written and fsynced into two directories, then:
  1. bytes on disk / raw: the pages, and the whole files (target for bf16: <= 0.75);
  2. saving: CPU seconds per GB of pages to encode (one thread) and the wall time to
     encode + write + fsync the chain on the 4 write threads a worker has;
  3. restoring the chain into preallocated buffers the way ``restore`` reads (raw: one
     sequential stream when cold, 4 threads when in the page cache; compressed: 4
     threads, a cold file read ahead by the kernel), warm (page cache) and cold (fsync +
     POSIX_FADV_DONTNEED), then cold again on this machine's disk throttled to the
     reference host's disk bandwidth per decoding CPU (``DISK_PER_DECODER`` x the CPUs
     here; root and a block-I/O cgroup controller, else "not measured"); ratio compressed
     / raw (target cold: <= 1.0) beside a raw read of the raw files;
  4. decode while saving (unless --skip-decode): engine_bench's batch (4 x 1024-token
     prompts, 256 tokens each, a continued save every 128 tokens) on the wide model, with
     no connector, kvdisk compression off and kvdisk compression zstd, rounds
     interleaved; ratio of each kvdisk run to the plain run beside it.
Absolute times on this 2-core CPU mean little; the ratios are the result.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from common import close, make_llm, model_shape
from engine_bench import SETTLE_S, raw_reads, timed_generate
from io_bench import drop_cache
from throttle import throttled_reads

from vllm_kvdisk.core.encode import encode_checkpoint
from vllm_kvdisk.storage.fileread import read_meta, read_text, read_tokens, read_tool_map
from vllm_kvdisk.storage.fsdir import writev_all
from vllm_kvdisk.storage.pageread import read_ahead, read_layers_into

REPEAT = 5
# An H200 host's NVMe measured 1.8 GB/s of cold reads (one device, 1-16 threads alike);
# a worker there restores on its 4 reader threads (--kv-disk-io-threads), each on a core
# of its own: 0.45 GB/s of disk per decoding CPU. The throttled restore gives each CPU
# here that much disk, so reading and decoding stand in the proportion they have there.
DISK_PER_DECODER = 1.8e9 / 4
# The kernel's throttle lets one slice of its budget (up to 100 ms of reads) through at
# once after a pause; the throttled restore reads the chain as many times over as makes
# that burst under 1/10 of what it reads.
THROTTLE_BURST_S = 0.1


def engine_files(model: str, dtype: str, prompt_ids: list[int], work: str) -> list[str]:
    """The checkpoint files an engine (kvdisk, compression off) saves for ``prompt_ids``."""
    kv = os.path.join(work, f"kv-{os.path.basename(model)}-{dtype}")
    shutil.rmtree(kv, ignore_errors=True)
    from vllm_kvdisk.testing.harness import make_llm as harness_llm

    llm = harness_llm(
        model,
        kv,
        max_model_len=8192,
        llm_args={"dtype": dtype},
        kv_cache_min_tokens=128,
        kv_disk_compression="off",
    )
    try:
        timed_generate(llm, [prompt_ids], 1)
    finally:
        close(llm)
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(kv) for f in fs if f.endswith(".kv"))


def pages_of(path: str):
    """Everything needed to encode a file again: its parts and its decoded pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        meta = read_meta(fd, os.fstat(fd).st_size)
        layers = []
        for i in range(meta.payload.layout.num_layers):
            buf = bytearray(meta.offsets.layer_size(i))
            read_layers_into(fd, meta, i, [memoryview(buf)])
            layers.append(buf)
        return meta, read_text(fd, meta), read_tokens(fd, meta), read_tool_map(fd, meta), layers
    finally:
        os.close(fd)


def encode(part, compress: bool):
    meta, text, tokens, tool_map, layers = part
    h = meta.header
    from dataclasses import replace

    from vllm_kvdisk.core.format import DTYPE_NAMES

    return encode_checkpoint(
        text=text,
        tokens=tokens,
        layers=layers,
        payload=replace(meta.payload, checksums=(), packing=None, version=2),
        reason=h.reason,
        kv_dtype=DTYPE_NAMES[h.kv_dtype],
        context_size=h.context_size,
        now=h.created,
        tool_map=tool_map,
        compress=compress,
    )


def write_file(path: str, enc) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        writev_all(fd, enc.buffers)
        os.fsync(fd)
    finally:
        os.close(fd)


def save_chain(parts, directory: str, compress: bool, pool: ThreadPoolExecutor) -> float:
    """Encode + write + fsync every file of the chain on ``pool``; wall seconds."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)

    def one(i: int) -> None:
        write_file(os.path.join(directory, f"{i}.kv"), encode(parts[i], compress))

    t0 = time.perf_counter()
    for fut in [pool.submit(one, i) for i in range(len(parts))]:
        fut.result()
    return time.perf_counter() - t0


def restore_chain(files: list[str], bufs, pool: ThreadPoolExecutor, cold: bool) -> float:
    """Read every file's pages into ``bufs`` as ``restore`` does; seconds."""
    if cold:
        for f in files:
            drop_cache(f)
    t0 = time.perf_counter()
    fds = [os.open(f, os.O_RDONLY) for f in files]
    try:
        futures = []
        for fd, layers in zip(fds, bufs):
            meta = read_meta(fd, os.fstat(fd).st_size)
            n = meta.payload.layout.num_layers
            if cold and meta.payload.packing is None:  # one sequential stream
                read_layers_into(fd, meta, 0, [memoryview(b) for b in layers])
                continue
            if cold:  # as restore does for a cold compressed file
                read_ahead(fd, meta)
            groups = min(n, 2 * pool._max_workers)
            cuts = [n * g // groups for g in range(groups + 1)]
            futures += [
                pool.submit(read_layers_into, fd, meta, a, [memoryview(b) for b in layers[a:b]])
                for a, b in zip(cuts, cuts[1:])
                if b > a
            ]
        for fut in futures:
            fut.result()
    finally:
        for fd in fds:
            os.close(fd)
    return time.perf_counter() - t0


def measure(name: str, files: list[str], work: str) -> None:
    parts = [pages_of(f) for f in files]
    raw_pages = sum(len(b) for p in parts for b in p[4])
    encs = {c: [encode(p, c) for p in parts] for c in (False, True)}
    sizes = {c: sum(e.size for e in encs[c]) for c in encs}
    stored = sum(e.stored_page_bytes for e in encs[True])
    t0 = time.thread_time()
    for p in parts:
        encode(p, True)
    enc_cpu = time.thread_time() - t0
    t0 = time.thread_time()
    for p in parts:
        encode(p, False)
    raw_cpu = time.thread_time() - t0
    gb = raw_pages / 1e9
    print(
        f"{name}: {len(files)} files, {raw_pages / 1e6:.1f} MB of pages\n"
        f"  1. on disk: pages {stored / raw_pages:.3f} of raw; files {sizes[True] / 1e6:.1f} MB "
        f"vs {sizes[False] / 1e6:.1f} MB -> {sizes[True] / sizes[False]:.3f}"
    )
    pool = ThreadPoolExecutor(4)
    dirs = {c: os.path.join(work, f"{name}-{'zstd' if c else 'raw'}") for c in (False, True)}
    save = {c: [] for c in (False, True)}
    for _ in range(REPEAT):
        for c in (False, True):
            save[c].append(save_chain(parts, dirs[c], c, pool))
    s_raw, s_zstd = statistics.median(save[False]), statistics.median(save[True])
    print(
        f"  2. saving: encode CPU {enc_cpu / gb:.2f} s/GB compressed vs {raw_cpu / gb:.2f} s/GB "
        f"raw (one thread); encode + write + fsync on 4 threads {s_zstd * 1e3:.0f} ms vs "
        f"{s_raw * 1e3:.0f} ms raw -> {s_zstd / s_raw:.2f}x"
    )
    files_of = {c: sorted(os.path.join(dirs[c], f) for f in os.listdir(dirs[c])) for c in dirs}
    bufs = [[bytearray(len(b)) for b in p[4]] for p in parts]

    def restores(cold: bool, what: str, copies: int = 1) -> None:
        """Restore the chain (``copies`` times over, as one chain of that many copies of
        its files), compressed and raw, interleaved ``REPEAT`` times."""
        files = {c: copied(files_of[c], copies) for c in files_of}
        into = [[bytearray(len(b)) for b in layers] for layers in bufs * (copies - 1)]
        targets = bufs + into
        t = {c: [] for c in (False, True)}
        raw = []
        for _ in range(REPEAT):
            for c in (False, True):
                t[c].append(restore_chain(files[c], targets, pool, cold))
                if c:  # the decoded pages are the engine's, byte for byte
                    assert all(
                        bytes(b) == bytes(o)
                        for bb, p in zip(targets, parts * copies)
                        for b, o in zip(bb, p[4])
                    )
            raw.append(raw_reads(files[False], pool, cold, 1))
        r, z, rr = (statistics.median(x) for x in (t[False], t[True], raw))
        print(
            f"  3. restore {what}: compressed {z * 1e3:.1f} ms vs raw {r * 1e3:.1f} ms -> "
            f"{z / r:.2f}x{' (target <= 1.0)' if cold else ''}; a raw read of the raw files "
            f"{rr * 1e3:.1f} ms ({copies * raw_pages / 1e9 / z:.2f} GB/s of pages decoded)"
        )

    restores(False, "warm (page cache)")
    restores(True, "cold (dropped from the page cache), this machine's disk")
    bps = int(DISK_PER_DECODER * (os.cpu_count() or 1))
    copies = max(1, math.ceil(THROTTLE_BURST_S * 10 * bps / raw_pages))
    with throttled_reads(work, bps) as why:
        what = f"cold, the disk throttled to {bps / 1e9:.2f} GB/s, the chain {copies}x over"
        if why:
            print(f"  3. restore {what}: not measured ({why})")
        else:
            restores(True, what, copies)
    pool.shutdown()


def copied(files: list[str], copies: int) -> list[str]:
    """``files`` and ``copies - 1`` copies of them (other inodes: each its own page cache)."""
    out = list(files)
    for k in range(1, copies):
        for f in files:
            out.append(f"{f}.copy{k}")
            if not os.path.exists(out[-1]):
                shutil.copyfile(f, out[-1])
    return out


def decode_while_saving(work: str) -> None:
    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    shape = model_shape(768, 8)
    model = str(build_tiny_model(os.path.join(work, "wide-decode"), shape=shape))
    rng = np.random.default_rng(0)

    def batch():
        return [rng.integers(10, 4000, 1024).tolist() for _ in range(4)]

    engines = {
        "plain": make_llm(model, None),
        "off": make_llm(
            model,
            os.path.join(work, "kv-off"),
            kv_cache_continued_interval_tokens=128,
            kv_disk_compression="off",
        ),
        "zstd": make_llm(
            model,
            os.path.join(work, "kv-zstd"),
            kv_cache_continued_interval_tokens=128,
            kv_disk_compression="zstd",
        ),
    }
    try:
        for llm in engines.values():
            timed_generate(llm, batch(), 8)
        times = {k: [] for k in engines}
        for _ in range(3):
            prompts = batch()
            for name, llm in engines.items():
                time.sleep(SETTLE_S)
                times[name].append(timed_generate(llm, prompts, 256))
    finally:
        for llm in engines.values():
            close(llm)
    ratios = {
        k: statistics.median(a / b for a, b in zip(times[k], times["plain"]))
        for k in ("off", "zstd")
    }
    print(
        "4. decode while saving (4 x 1024-token prompts, 256 tokens, continued saves every 128 "
        f"tokens), median of 3 rounds: plain {statistics.median(times['plain']):.2f} s | "
        f"kvdisk off / plain {ratios['off']:.3f} | kvdisk zstd (compressed) / plain "
        f"{ratios['zstd']:.3f} -> zstd / off {ratios['zstd'] / ratios['off']:.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--only-decode", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    here = os.path.dirname(os.path.abspath(__file__))
    smol = subprocess.run(
        [sys.executable, os.path.join(here, "prepare_smollm2.py")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    work = tempfile.mkdtemp(prefix="kvdisk-compression-bench-", dir=os.environ.get("BENCH_DIR"))
    try:
        tok = AutoTokenizer.from_pretrained(smol)
        docs = os.path.join(here, "..", "docs")
        text = "".join(open(os.path.join(docs, f)).read() for f in ("DESIGN.md", "FORMAT.md"))
        messages = [
            {"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": text},
        ]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        chat = tok(rendered, add_special_tokens=False)["input_ids"][: args.tokens]
        wide = str(build_tiny_model(os.path.join(work, "wide"), shape=model_shape(768, 8)))
        ids = np.random.default_rng(1).integers(10, 4000, args.tokens).tolist()
        sources = () if args.only_decode else (("SmolLM2", smol, chat), ("wide random", wide, ids))
        for label, model, prompt in sources:
            for dtype in ("bfloat16", "float32"):
                files = engine_files(model, dtype, prompt, work)
                measure(f"{label} {dtype}", files, work)
        if not args.skip_decode:
            decode_while_saving(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
