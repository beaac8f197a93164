"""What agent_replay measures beside the client's clocks: CPU time of a server's process
tree, the engine's cores, disk usage, the server's prompt-token counters by source, and
the storage's own limit (a raw read of the cache's files, the ideal a restore is held to)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import time

import numpy as np


def _tree_cpu_s(pid: int) -> float:
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


class CpuMeter:
    """Average cores busy during a phase: the server's processes, this client, and
    everything else on the machine (other jobs would distort the timings)."""

    def __init__(self, server_pid: int):
        import psutil

        self.pid, self._psutil = server_pid, psutil
        self.t0, self.sys0 = time.perf_counter(), self._busy()
        self.srv0, self.me0 = _tree_cpu_s(server_pid), self._me()

    def _busy(self) -> float:
        t = self._psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    @staticmethod
    def _me() -> float:
        t = os.times()
        return t.user + t.system

    def read(self) -> dict:
        wall = time.perf_counter() - self.t0
        busy = self._busy() - self.sys0
        srv = _tree_cpu_s(self.pid) - self.srv0
        me = self._me() - self.me0
        return {
            "wall_s": round(wall, 2),
            "machine_cores": round(busy / wall, 2),
            "server_cores": round(srv / wall, 2),
            "client_cores": round(me / wall, 2),
            "other_cores": round(max(0.0, busy - srv - me) / wall, 2),
        }


def engine_cores(log_path: str) -> str | None:
    """The CPU build's OpenMP binding of the engine's worker, from the latest start-up."""
    found = None
    with open(log_path, errors="replace") as fh:
        for line in fh:
            if "core ids=" in line:
                found = line.split("core ids=", 1)[1].strip()
    return found


def disk_usage(path: str | None) -> dict:
    if not path or not os.path.isdir(path):
        return {"bytes": 0, "files": 0}
    total = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
                files += 1
            except OSError:
                pass
    return {"bytes": total, "files": files}


def unique_blocks(sequences: list, block_size: int) -> int:
    """Distinct KV blocks among the token sequences a server computed: the blocks of their
    prefix tree (two sequences share a block when they agree on every token up to its end),
    what a cache that stores each block once would hold."""
    import hashlib

    seen: set[bytes] = set()
    for seq in sequences:
        h = hashlib.sha1()
        raw = bytes(memoryview(seq.astype("<u4")))
        step = 4 * block_size
        for at in range(0, len(raw) - step + 1, step):
            h.update(raw[at : at + step])
            seen.add(h.digest())
    return len(seen)


def token_sources(before: dict, after: dict) -> dict:
    """The server's own split of prompt tokens over a phase (counters' difference)."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    out = {
        src: int(delta(f'vllm:prompt_tokens_by_source_total{{source="{src}"}}'))
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    for key in after:
        if key.startswith("vllm:kvdisk_") and (
            key.endswith(("_total", "_sum", "_count")) or "_total{" in key
        ):
            out[key.removeprefix("vllm:")] = delta(key)
    return out


def storage_limit(cache_dir: str, phases: dict, threads: int = 4) -> dict:
    """The machine's own bandwidth on this run's checkpoint files against what the
    server's restore and save paths achieved on them (its load/save histograms)."""
    from io_bench import CHUNK, drop_cache, raw_read, raw_write

    paths = [
        os.path.join(d, f)
        for d, _, fs in os.walk(cache_dir)
        for f in fs
        if f.endswith(".kv") and "quarantine" not in d
    ]
    sizes = [os.path.getsize(p) for p in paths]
    total = sum(sizes)
    if not total:
        return {}
    buf = memoryview(np.ones(max(sizes), dtype=np.uint8))
    pool = cf.ThreadPoolExecutor(threads)

    def timed(fn, cold: bool) -> float:
        runs = []
        for _ in range(3):
            if cold:
                for p in paths:
                    drop_cache(p)
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return sorted(runs)[1]

    def read_all(threaded: bool) -> None:
        for p, n in zip(paths, sizes):
            raw_read(p, buf[:n], CHUNK if threaded else n, pool if threaded else None)

    read_all(True)
    warm = timed(lambda: read_all(True), cold=False)
    cold = timed(lambda: read_all(False), cold=True)
    scratch = os.path.join(os.path.dirname(cache_dir), "write-limit")
    os.makedirs(scratch, exist_ok=True)
    counter = iter(range(10**9))
    write = timed(lambda: [raw_write(scratch, [buf[:n]], next(counter)) for n in sizes], cold=False)
    shutil.rmtree(scratch, ignore_errors=True)
    pool.shutdown()
    tok = [ph.get("tokens", {}) for ph in phases.values()]
    read_b = sum(t.get("kvdisk_bytes_read_total", 0) for t in tok)
    read_s = sum(t.get("kvdisk_load_seconds_sum", 0) for t in tok)
    wrote_b = sum(t.get("kvdisk_bytes_written_total", 0) for t in tok)
    wrote_s = sum(t.get("kvdisk_save_seconds_sum", 0) for t in tok)
    out = {
        "files": len(paths),
        "bytes": total,
        "limit_read_warm_gbps": total / warm / 1e9,
        "limit_read_cold_gbps": total / cold / 1e9,
        "limit_write_fsync_gbps": total / write / 1e9,
        "server_restore_bytes": read_b,
        "server_restore_s": read_s,
        "server_save_bytes": wrote_b,
        "server_save_s": wrote_s,
    }
    if read_b and read_s:
        out["server_restore_gbps"] = read_b / read_s / 1e9
    if wrote_b and wrote_s:
        out["server_save_gbps"] = wrote_b / wrote_s / 1e9
    return out
