"""A shared volume (GlusterFS, two FUSE mounts) against the local disk, on the same files.

    .venv/bin/python benchmarks/shared_volume_bench.py [--files 10000,100000] [--io]
    .venv/bin/python benchmarks/shared_volume_bench.py --dirs LOCAL MOUNT_A MOUNT_B

No engine. By default a GlusterFS volume is made on the local disk and mounted twice
(``vllm_kvdisk.testing.gluster``; root and the glusterfs packages are needed); ``--dirs``
uses directories that exist (two mounts of one network volume, and a local one). For
each file count, the same checkpoint files are written to the local directory and,
through mount A, to the volume; then, each side by side:

* start-up: a scan that reads every file's first bytes (no journal yet), through the
  client that did not write them (mount B: a replica starting); writing the journal's
  snapshot; a start from the journal (one file); the listing a started store runs once
  in the background to find what the journal missed;
* a refresh with nothing changed, and the one after another client saved a file (the
  journal's new line, read through the other mount);
* a save when nothing changed since this store's last look, one after another client's
  save, and a save that must evict (its victims stat'ed, nothing listed);
* a lookup at first sight: a two-file chain used whole (no I/O), and the read of a
  file's stored ids that a lookup leaving a file inside costs, once per file;
* the longest hold of ``ROOT/.lock`` (``DirLock.longest_hold_s``: from the flock to its
  release): of ``kvdisk verify --fix`` (one file corrupted first, so it quarantines it
  and deletes its child), of the first save after it, and of a save whose eviction plans
  failed ``RECHECKS`` times (before each check, the victims' mtimes are moved, as another
  replica's hits do). While one replica holds the lock, every other one's saves
  wait, then skip after ``kv_disk_lock_timeout_s`` (10 s). ``--holds-only``: only these;
* ``--io``: save and restore bandwidth of the worker's I/O path (``io_bench.py``) against a
  plain read and write of the same bytes, on each directory.

Ratios are volume / local (times: above 1 is slower on the volume).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from core_index import FP, LAYOUT, make_files

from vllm_kvdisk.core.encode import encode_plan
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.planner import Planner, Prompt, SavePlan
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.storage.budget import RECHECKS
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify
from vllm_kvdisk.testing import gluster

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT_BYTES = 512


def table() -> TokenTable:
    """make_files' token table (its prompts are ``rng(0).integers(0, 256, 300)`` each)."""
    return TokenTable([bytes([65 + i % 26]) * max(1, TEXT_BYTES // 256) for i in range(256)])


def copy_tree(src: str, dst: str, threads: int = 16) -> float:
    """Copy the namespace directories of ``src`` into ``dst`` (a network volume answers
    one small write at a time per thread: 16 threads). Seconds taken."""
    t0 = time.perf_counter()
    jobs = []
    for ns in os.listdir(src):
        if os.path.isdir(os.path.join(src, ns)):
            os.makedirs(os.path.join(dst, ns), exist_ok=True)
            jobs += [
                (os.path.join(src, ns, n), os.path.join(dst, ns, n))
                for n in os.listdir(os.path.join(src, ns))
            ]

    def cp(pair: tuple[str, str]) -> None:
        with open(pair[0], "rb") as fh:
            data = fh.read()
        with open(pair[1], "wb") as fh:
            fh.write(data)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(cp, jobs))
    return time.perf_counter() - t0


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_file(store: Store, ns: str, seed: int) -> str:
    """Save one small root checkpoint through ``store`` (the real write path: temp file,
    fsync, the lock, the rename)."""
    prompt = Prompt(table(), np.random.default_rng(10_000 + seed).integers(0, 256, 200))
    plan = SavePlan(ns, prompt.sha1_at(128), 128, None, 0, Reason.COLD)
    enc = encode_plan(
        plan,
        text=prompt.text_upto(128),
        ids=prompt.ids,
        layers=[bytes(LAYOUT.page_bytes)],
        layout=LAYOUT,
        fingerprint=FP.digest(),
        kv_dtype="float32",
        context_size=8192,
        now=1_700_000_000,
    )
    store.write(ns, plan.sha1, enc)
    return plan.sha1


def wait_refresh(store: Store, ns: str, sha1: str, deadline_s: float = 10.0) -> float:
    """Seconds of the refresh call that indexed another client's file ``sha1`` (earlier
    calls may not see it yet through this client's caches)."""
    end = time.monotonic() + deadline_s
    while True:
        t0 = time.perf_counter()
        store.refresh(ns)
        took = time.perf_counter() - t0
        if store.index.get(ns, sha1) is not None:
            return took
        if time.monotonic() > end:
            raise SystemExit(f"another client's new file was not seen within {deadline_s:g} s")
        time.sleep(0.05)


def measure(root: str, other: str, n: int) -> dict[str, float]:
    """``root``: the directory as the writer sees it; ``other``: the same directory through
    another client (the local disk: itself)."""
    out: dict[str, float] = {}
    store = Store(other, space_bytes=1 << 50)
    out["start-up scan, every header (no journal)"] = timed(store.scan)
    if len(store.index) != n:
        raise SystemExit(f"scan of {other} found {len(store.index)} of {n} files")
    out["journal snapshot written"] = timed(lambda: store.scanner.write_snapshot(60))
    store = Store(other, space_bytes=1 << 50)
    out["start-up from the journal"] = timed(store.scanner.start)
    if len(store.index) != n:
        raise SystemExit(f"the journal gave {len(store.index)} of {n} files")
    out["listing after a start (background)"] = timed(store.scanner.reconcile)
    ns = store.namespaces()[0]
    out["refresh, nothing changed"] = statistics.median(
        timed(lambda: store.refresh(ns)) for _ in range(20)
    )
    writer = Store(root, space_bytes=1 << 50)
    if not writer.scanner.start():
        raise SystemExit("the writer did not start from the journal")
    out["refresh after another client's save"] = wait_refresh(store, ns, one_file(writer, ns, 0))
    one_file(store, ns, 1)
    out["save, nothing changed since"] = statistics.median(
        timed(lambda i=i: one_file(store, ns, 10 + i)) for i in range(5)
    )
    one_file(writer, ns, 2)
    out["save after another client's save"] = timed(lambda: one_file(store, ns, 3))
    full = store.index.total_bytes
    store.space_bytes = full + 1  # the next save must evict
    out["save that evicts"] = timed(lambda: one_file(store, ns, 4))
    store.space_bytes = 1 << 50
    planner = Planner(store.index, LAYOUT.block_size, store.read_ids, 1)
    ids = Prompt(table(), np.random.default_rng(0).integers(0, 256, 300)).ids
    whole = planner.lookup(ns, ids, len(ids) - 1)
    if whole.tokens != 256 or len(whole.segments) != 2:
        raise SystemExit(f"lookup found {whole.tokens} tokens in {len(whole.segments)} files")
    out["lookup, chain used whole"] = statistics.median(
        timed(lambda: planner.lookup(ns, ids, len(ids) - 1)) for _ in range(20)
    )
    fresh = Store(other, space_bytes=1 << 50)  # a lookup that uses a file partly reads
    fresh.scanner.start()  # its stored ids, once: at first sight
    entry = fresh.index.get(ns, whole.segments[-1].entry.sha1)
    out["stored ids of a file, first sight"] = timed(lambda: fresh.read_ids(entry, 0, entry.tokens))
    return out


def corrupt_one(root: str) -> str:
    """Overwrite the last bytes (its pages) of one root checkpoint that has a child, through
    ``root``: verify proves it corrupt. Returns its name."""
    store = Store(root, space_bytes=1 << 50, readonly=True)
    ns = store.namespaces()[0]
    names = sorted(n for n in os.listdir(os.path.join(root, ns)) if n.endswith(".kv"))
    for name in names:
        path = os.path.join(root, ns, name)
        with open(path, "r+b") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(size - 64)
            fh.write(b"\xa5" * 64)
            os.fsync(fh.fileno())
        return name
    raise SystemExit(f"no checkpoint in {root}/{ns}")


def lock_holds(root: str, other: str, jobs: int) -> dict[str, float]:
    """The longest ``ROOT/.lock`` hold of ``verify --fix`` and of a save after failed
    eviction plans, through ``other`` (``root``: the writer's mount, where the corruption
    and the other replica's hits are made)."""
    out: dict[str, float] = {}
    corrupt_one(root)
    store = Store(other, space_bytes=1 << 50)
    store.lock.longest_hold_s = 0.0
    t0 = time.perf_counter()
    report = verify(store, jobs=jobs)
    out["verify --fix, whole run"] = time.perf_counter() - t0
    out["verify --fix, longest lock hold"] = store.lock.longest_hold_s
    if report.fixed < 1:
        raise SystemExit(f"verify --fix fixed nothing: {report.problems[:3]}")
    ns = store.namespaces()[0]
    store.lock.longest_hold_s = 0.0
    out["first save after verify --fix, whole save"] = timed(lambda: one_file(store, ns, 21))
    out["first save after verify --fix, longest lock hold"] = store.lock.longest_hold_s
    real = store.scanner.verify_victims
    failed = 0

    def hit_then_verify(plan: list) -> bool:  # another replica's hits on every victim
        nonlocal failed
        if failed < RECHECKS:
            failed += 1
            for entry in plan:
                # Through this store's own mount: another mount's change reaches it only
                # after its attribute cache expires (GlusterFS's FUSE client: 1 s).
                path = os.path.join(other, entry.ns, f"{entry.sha1}.kv")
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(path)
                    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        return real(plan)

    store.scanner.verify_victims = hit_then_verify  # type: ignore[method-assign]
    store.space_bytes = store.index.total_bytes + 1  # the next save must evict
    store.lock.longest_hold_s = 0.0
    out["save after failed eviction plans, whole save"] = timed(lambda: one_file(store, ns, 20))
    out["save after failed eviction plans, longest lock hold"] = store.lock.longest_hold_s
    if failed != RECHECKS:
        raise SystemExit(f"the save's eviction plans failed {failed} times, not {RECHECKS}")
    return out


def io_numbers(directory: str, args: argparse.Namespace) -> dict[str, float]:
    """io_bench.py on ``directory``: restore/limit warm and cold, save/limit, and GB/s."""
    cmd = [
        sys.executable,
        os.path.join(HERE, "io_bench.py"),
        "--tokens",
        str(args.io_tokens),
        "--layers",
        "8",
        "--repeat",
        "3",
        "--chain-files",
        "4",
        "--turns",
        "8",
    ]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "KVDISK_BENCH_DIR": directory},
    )
    if done.returncode != 0:
        raise SystemExit(f"io_bench on {directory} failed:\n{done.stdout}\n{done.stderr}")
    text = done.stdout
    out: dict[str, float] = {}
    for label, key in (("page cache", "warm"), ("cold", "cold")):
        m = re.search(
            rf"restore, {label}.*?restore\s+[\d.]+ ms\s+([\d.]+) GB/s.*?"
            rf"restore/limit \(([^)]*)\) ([\d.]+)",
            text,
            re.S,
        )
        if m:
            out[f"restore GB/s, {key}"] = float(m.group(1))
            out[f"restore / plain read, {key}"] = float(m.group(3))
    m = re.search(
        r"save \(write\+fsync\):\s+[\d.]+ ms\s+([\d.]+) GB/s.*?raw writev\+fsync\s+"
        r"[\d.]+ ms\s+([\d.]+) GB/s.*?save/limit.*?([\d.]+)\s*$",
        text,
        re.M,
    )
    if m:
        out["save GB/s"], out["plain write+fsync GB/s"] = float(m.group(1)), float(m.group(2))
        out["save / plain write"] = float(m.group(3))
    return out


def show(title: str, local: dict[str, float], shared: dict[str, float], unit: str) -> None:
    print(f"\n{title}")
    print(f"  {'':54} {'local':>12} {'volume':>12} {'volume/local':>13}")
    for key in local:
        a, b = local[key], shared.get(key, float("nan"))
        scale = 1e3 if unit == "ms" else 1.0
        print(
            f"  {key:54} {a * scale:10.3f}{unit:>2} {b * scale:10.3f}{unit:>2} "
            f"{b / a if a else float('nan'):12.2f}x"
        )


@contextlib.contextmanager
def directories(args: argparse.Namespace) -> Iterator[tuple[str, str, str]]:
    if args.dirs:
        yield tuple(args.dirs)  # type: ignore[misc]
        return
    base = tempfile.mkdtemp(prefix="kvdisk-bench-volume-")
    os.rmdir(base)  # the volume's helper makes (and removes) it
    local = tempfile.mkdtemp(prefix="kvdisk-bench-local-")
    try:
        with gluster.volume(base) as vol:
            print(
                f"GlusterFS volume up in {vol.timings['setup_s']:.1f} s "
                f"({'its own glusterd' if vol.own_glusterd else 'a running glusterd'})"
            )
            yield local, vol.mounts[0], vol.mounts[1]
    finally:
        shutil.rmtree(local, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", default="10000", help="comma-separated file counts")
    ap.add_argument("--dirs", nargs=3, metavar=("LOCAL", "MOUNT_A", "MOUNT_B"))
    ap.add_argument("--io", action="store_true", help="also save/restore bandwidth")
    ap.add_argument("--io-tokens", type=int, default=2048)
    ap.add_argument("--holds-only", action="store_true", help="only the longest lock holds")
    ap.add_argument("--verify-jobs", type=int, default=4, help="verify --fix's --jobs")
    args = ap.parse_args()
    with directories(args) as (local, mount_a, mount_b):
        for n in [int(x) for x in args.files.split(",")]:
            sub = f"bench-{n}-{os.getpid()}"
            src = os.path.join(local, sub)
            t0 = time.perf_counter()
            written = make_files(src, n, TEXT_BYTES)
            made = time.perf_counter() - t0
            copied = copy_tree(src, os.path.join(mount_a, sub))
            print(
                f"\n{written} files ({TEXT_BYTES} bytes of text each, half roots, half "
                f"deltas): written locally in {made:.1f} s, copied to the volume in "
                f"{copied:.1f} s (16 threads)"
            )
            a, b = os.path.join(mount_a, sub), os.path.join(mount_b, sub)
            loc = {} if args.holds_only else measure(src, src, written)
            vol = {} if args.holds_only else measure(a, b, written)
            loc.update(lock_holds(src, src, args.verify_jobs))
            vol.update(lock_holds(a, b, args.verify_jobs))
            show(
                f"{written} files: local disk against the volume (through the other mount)",
                loc,
                vol,
                "ms",
            )
            shutil.rmtree(src, ignore_errors=True)
        if args.io:
            loc = io_numbers(local, args)
            vol = io_numbers(mount_a, args)
            show(
                f"save and restore, {args.io_tokens} tokens x 8 layers (io_bench.py; here "
                "higher is better: GB/s, and the path against a plain read or write of the "
                "same bytes on the same directory)",
                loc,
                vol,
                "",
            )


if __name__ == "__main__":
    main()
