"""The connector inside a real engine: step time while saving, and time to first token.

    .venv/bin/python benchmarks/engine_bench.py [--prompt-tokens 5000,10000] [--layers 8]

Builds a random-weight Llama of the given shape (bigger than the test model so prefill
costs something), then in one run, with vLLM's default multi-process engine:
  1. decode with saves: the same batch generated with no connector and with kvdisk
     (cold saves, plus a continued save every --continued-interval computed tokens,
     default 128: far more often than ds4's 10000); ratio of wall times, each kvdisk run
     against the no-connector run beside it. A second no-connector engine runs in the
     same rounds: its ratio to the first is what this machine's noise alone gives (an
     A/A control), the band a kvdisk ratio must leave to mean anything. The CPU time of
     each engine's threads per run says where the connector's work went;
  2. time to first token for long prompts that sit between ds4's grid points (2048/32):
     cold prefill, a device (GPU-resident) prefix-cache hit, and a disk restore in a
     fresh engine on the same cache directory (a restart). Target: the restore within
     1.5x of the device hit;
  3. the same restore with the files dropped from the page cache, against the device hit
     plus a raw cold read of the same files (the prompt's chain, 4 threads). Target: at
     most the device hit + 1.1x that read;
  4. the restore inside the server (the trace's load time) against a raw read of the same
     files, page cache and cold, the raw read made right after each restore (the same
     moment of a machine whose memory bandwidth drifts by 2x over minutes), and once more
     after the engine closed (nothing else running). Target: raw / restore >= 0.9;
  5. the peak of host staging memory saves in flight held, against its cap.
Absolute times on a 2-core CPU mean little; the ratios are the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from common import close, kv_bytes_per_token, make_llm, model_shape
from io_bench import CHUNK, drop_cache, raw_read

from vllm_kvdisk.core.config import KVDiskConfig
from vllm_kvdisk.ops import trace
from vllm_kvdisk.storage.fileread import read_meta

SETTLE_S = 1.5
CPU_KINDS = ("worker main thread", "engine core main thread", "worker's other threads")


def started(procs: dict, name: str, make):
    """``make()`` an engine and remember the processes it started under ``name``."""
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = make()
    procs[name] = {p.pid for p in psutil.Process().children(recursive=True)} - before
    return llm


def thread_cpu(pids: set[int]) -> dict[tuple[int, int, str], float]:
    """CPU seconds so far of every thread of ``pids``: (pid, tid, process name) -> s."""
    import psutil

    out = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for t in proc.threads():
                out[pid, t.id, proc.name()] = t.user_time + t.system_time
        except psutil.Error:
            pass
    return out


def cpu_by_kind(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds between two ``thread_cpu`` readings: the worker's main thread (the
    forward), the engine core's (scheduling), and the worker's other threads (kvdisk's
    copies and writes, and a few of vLLM's). Both main threads busy-poll while they wait
    for each other, so their CPU time follows the wall time; the other threads' is work."""
    out = dict.fromkeys(CPU_KINDS, 0.0)
    for (pid, tid, name), s in after.items():
        worker, core = "Worker" in name, "EngineCor" in name  # names are cut at 15 chars
        kind = (
            CPU_KINDS[0]
            if worker and pid == tid
            else CPU_KINDS[1]
            if core and pid == tid
            else CPU_KINDS[2]
            if worker
            else None
        )
        if kind:
            out[kind] += s - before.get((pid, tid, name), 0.0)
    return out


def timed_generate(llm, prompts, max_tokens) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0


def kv_paths(kv: str) -> dict[str, str]:
    return {
        f[:-3]: os.path.join(d, f)
        for d, _, fs in os.walk(kv)
        for f in fs
        if f.endswith(".kv") and "quarantine" not in d
    }


def chain(paths: dict[str, str], sha1: str | None) -> list[str]:
    """The file ``sha1`` and its ancestors: what a restore of it reads."""
    out = []
    while sha1:
        out.append(paths[sha1])
        fd = os.open(out[-1], os.O_RDONLY)
        try:
            sha1 = read_meta(fd, os.fstat(fd).st_size).payload.parent_sha1
        finally:
            os.close(fd)
    return out


def raw_reads(files: list[str], pool: ThreadPoolExecutor, cold: bool, repeat: int) -> float:
    """Median time of a raw read of ``files`` (4 threads per file), cold: after dropping
    them from the page cache."""
    sizes = [os.path.getsize(f) for f in files]
    buf = memoryview(np.ones(max(sizes), dtype=np.uint8))
    runs = []
    for _ in range(repeat):
        if cold:
            for f in files:
                drop_cache(f)
        t0 = time.perf_counter()
        for f, n in zip(files, sizes):
            raw_read(f, buf[:n], CHUNK, pool)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def loads_traced(trace_path: str, seen: int) -> tuple[list[tuple[str, float]], int]:
    """(head sha1, load seconds) of each restore the trace logged after the first ``seen``."""
    loaded = trace.read(trace_path, kinds=["loaded"])
    return [(e.sha1, e.ms / 1e3) for e in loaded[seen:]], len(loaded)


def staging_peak(worker) -> int:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.staging_peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--prompt-tokens",
        default="5000,10000",
        help="comma-separated prompt lengths for the TTFT part",
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--decode-repeat",
        type=int,
        default=5,
        help="rounds of part 1 (each: no connector, kvdisk, no connector again)",
    )
    ap.add_argument(
        "--continued-interval",
        type=int,
        default=128,
        help="continued-save interval while decoding (ds4 default: 10000)",
    )
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # two engines run at once
    # vLLM's CPU build reserves one core for a KV connector's engine but, on a 2-core
    # machine, then reserves none and binds both cores; without a connector it binds one.
    # Pin the same reservation for both so the comparison is of the connector alone.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    # The staging peak is read from the worker by a function sent to it (collective_rpc).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    work = tempfile.mkdtemp(prefix="kvdisk-engine-bench-")
    shape = model_shape(args.hidden, args.layers)
    model = str(build_tiny_model(os.path.join(work, "model"), shape=shape))
    kv = os.path.join(work, "kv")
    kv_per_token = kv_bytes_per_token(shape)
    rng = np.random.default_rng(0)

    def batch(n, length):
        return [rng.integers(10, 4000, length).tolist() for _ in range(n)]

    try:
        print(f"model: {shape}, {kv_per_token // 1024} KiB of KV per token (fp32)")
        runs = [batch(args.batch, 1024) for _ in range(args.decode_repeat)]
        # 1. decode while saving: all three engines up, runs interleaved so drift and
        # warm-up hit them alike -----------------------------------------------------------
        procs = {}  # engine -> the processes it started (engine core, worker)
        base = started(procs, "plain", lambda: make_llm(model, None))
        control = make_llm(model, None)  # A/A: the noise of two identical engines
        disk = started(
            procs,
            "kvdisk",
            lambda: make_llm(model, kv, kv_cache_continued_interval_tokens=args.continued_interval),
        )
        cpu = {name: [] for name in procs}  # per round: CPU seconds per kind of thread
        for llm in (base, control, disk):
            timed_generate(llm, batch(args.batch, 1024), 8)  # warm up
        plain, again, saving = [], [], []
        for prompts in runs:
            for name, llm, times in (
                ("plain", base, plain),
                ("kvdisk", disk, saving),
                (None, control, again),
            ):
                # Let the previous engine settle first: vLLM's worker polls for 1 s after
                # its last step, and a kvdisk run's last writes land after it returns.
                time.sleep(SETTLE_S)
                before = thread_cpu(procs[name]) if name else {}
                times.append(timed_generate(llm, prompts, args.decode_tokens))
                if name:
                    cpu[name].append(cpu_by_kind(before, thread_cpu(procs[name])))
        close(control)
        lengths = [int(n) for n in args.prompt_tokens.split(",")]
        longs = {n: batch(1, n)[0] for n in lengths}
        ttft_cold = {
            n: [timed_generate(base, [batch(1, n)[0]], 1) for _ in range(args.repeat)]
            for n in lengths
        }
        close(base)
        # 2. time to first token ---------------------------------------------------------
        ttft_device = {}
        for n, prompt in longs.items():
            timed_generate(disk, [prompt], 1)  # cold prefill; checkpoints land on disk
            ttft_device[n] = [timed_generate(disk, [prompt], 1) for _ in range(args.repeat)]
        peak = max(disk.collective_rpc(staging_peak))
        close(disk)
        files = sum(len(f) for _, _, f in os.walk(kv))
        trace_path = os.path.join(work, "trace.log")
        restarted = make_llm(model, kv, trace=trace_path)
        paths, seen = kv_paths(kv), 0
        ttft_disk = {n: [] for n in lengths}
        ttft_cold_disk = {n: [] for n in lengths}
        load_s = {(n, cold): [] for n in lengths for cold in (False, True)}
        heads = {}
        pool = ThreadPoolExecutor(4)
        beside = {(n, cold): [] for n in lengths for cold in (False, True)}  # raw/load pairs
        # Every page-cache restore first, then the cold ones: dropping the files for a cold
        # run would otherwise leave the next "warm" run partly cold.
        for cold in (False, True):
            for r in range(args.repeat):
                for n, prompt in longs.items():
                    restarted.reset_prefix_cache()  # every restore from disk, none from the device
                    if cold:
                        for path in paths.values():
                            drop_cache(path)
                    (ttft_cold_disk if cold else ttft_disk)[n].append(
                        timed_generate(restarted, [prompt], 1)
                    )
                    loads, seen = loads_traced(trace_path, seen)
                    if len(loads) == 1:
                        heads[n] = loads[0][0]
                        load_s[n, cold].append(loads[0][1])
                        # The same files read raw at once, in the same page-cache state.
                        rr = raw_reads(chain(paths, heads[n]), pool, cold, 1)
                        beside[n, cold].append(rr / max(loads[0][1], 1e-4))
        close(restarted)
        raw = {
            (n, cold): raw_reads(chain(paths, heads[n]), pool, cold, args.repeat)
            for n in lengths
            if n in heads
            for cold in (False, True)
        }
        pool.shutdown()
        med = statistics.median
        pairs = [k / p for k, p in zip(saving, plain)]
        aa = [a / p for a, p in zip(again, plain)]
        print(
            f"1. batch of {args.batch} x 1024-token prompts, {args.decode_tokens} tokens each "
            f"({args.decode_repeat} rounds):"
        )
        print(
            f"   no connector {med(plain):.2f} s | kvdisk saving (cold + continued every "
            f"{args.continued_interval} tokens) {med(saving):.2f} s | ratio, median of the "
            f"rounds {med(pairs):.3f} (target <= 1.05); rounds "
            + " ".join(f"{x:.3f}" for x in pairs)
        )
        print(
            f"   A/A control, a second no-connector engine / the first: median {med(aa):.3f}; "
            "rounds " + " ".join(f"{x:.3f}" for x in aa)
        )
        print(
            "   CPU seconds per run, median (less noisy than wall time): "
            + " | ".join(
                f"{name}: "
                + ", ".join(f"{kind} {med(r[kind] for r in cpu[name]):.2f}" for kind in CPU_KINDS)
                for name in cpu
            )
        )
        print(
            f"2. time to first token, prompts between ds4 grid points, {files} files on disk "
            f"(median of {args.repeat}):"
        )
        for n in lengths:
            c, d, k = med(ttft_cold[n]), med(ttft_device[n]), med(ttft_disk[n])
            print(
                f"   {n} tokens ({n * kv_per_token / 1e6:.0f} MB of KV): cold prefill "
                f"{c * 1e3:.0f} ms | device prefix-cache hit {d * 1e3:.0f} ms | disk restore "
                f"after restart {k * 1e3:.0f} ms -> disk/device {k / d:.2f} (target <= 1.5), "
                f"cold/disk {c / k:.1f}x"
            )
        print(
            "3. the same restore with its files dropped from the page cache; raw: a cold "
            "read of the prompt's chain, 4 threads:"
        )
        for n in lengths:
            if n not in heads:
                print(f"   {n} tokens: no restore was traced")
                continue
            d, k, rc = med(ttft_device[n]), med(ttft_cold_disk[n]), raw[n, True]
            print(
                f"   {n} tokens: disk restore (cold) {k * 1e3:.0f} ms | device hit "
                f"{d * 1e3:.0f} ms + 1.1 x raw cold read {rc * 1e3:.0f} ms = "
                f"{(d + 1.1 * rc) * 1e3:.0f} ms -> (restore - device) / raw "
                f"{(k - d) / rc:.2f} (target <= 1.1)"
            )
        print(
            "4. restore inside the server (the trace's load time) / a raw read of the same "
            "files, 4 threads: beside it (read right after each restore), and after the "
            "engine closed:"
        )
        for n in lengths:
            if n not in heads:
                continue
            parts = []
            for cold, label in ((False, "page cache"), (True, "cold")):
                if load_s[n, cold]:
                    ls, rr = med(load_s[n, cold]), raw[n, cold]
                    parts.append(
                        f"{label}: load {ls * 1e3:.0f} ms, raw/load beside "
                        f"{med(beside[n, cold]):.2f} (rounds "
                        + " ".join(f"{x:.2f}" for x in beside[n, cold])
                        + f"), after close raw {rr * 1e3:.0f} ms -> "
                        f"{rr / ls if ls else float('inf'):.2f}"
                    )
            print(f"   {n} tokens: " + " | ".join(parts) + " (target >= 0.9)")
        cap = {f.name: f.default for f in dataclasses.fields(KVDiskConfig)}[
            "kv_disk_staging_inflight_mb"
        ]
        print(
            f"5. staging held by saves in flight: peak {peak / 2**20:.1f} MiB of the "
            f"{cap} MiB cap (kv_disk_staging_inflight_mb)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
