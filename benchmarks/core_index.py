"""Start-up scan of a large cache directory and lookup time for a long prompt.

    .venv/bin/python benchmarks/core_index.py [--files 100000] [--prompt-tokens 131072]

Targets (issue: core): 100k files indexed in < 2 s from headers alone; a lookup for a
128k-token prompt (render text, hash every grid prefix, probe the index, check token
digests) in < 2 ms. Prints measured times and their ratio to the target.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from vllm_kvdisk.format import PageLayout, Reason
from vllm_kvdisk.keys import Fingerprint, Grid, KeyCache, TokenTable
from vllm_kvdisk.planner import Planner, Prompt, encode_plan
from vllm_kvdisk.store import Store

LAYOUT = PageLayout("bench:LBHNC", 128, 1, (1, 128, 1), "float32")
FP = Fingerprint("bench", "0", "float32", LAYOUT.name, 128, 1, 0)


def make_files(root: str, count: int) -> str:
    """Write ``count`` small, valid checkpoints quickly (no fsync: setup, not the subject)."""
    store = Store(root, space_bytes=1 << 50)
    ns = store.ensure_namespace(FP)
    table = TokenTable([bytes([i]) for i in range(256)])
    grid = Grid(256, 32, 128)
    planner = Planner(store.index, grid)
    pages = [bytes(LAYOUT.page_bytes)]
    rng = np.random.default_rng(0)
    for _ in range(count):
        prompt = Prompt(table, grid, rng.integers(0, 256, 200))
        plan = planner.plan_save(ns, prompt, 128, Reason.COLD)
        enc = encode_plan(plan, text=prompt.text_upto(128), ids=prompt.ids, layers=pages,
                          layout=LAYOUT, fingerprint=FP.digest(), kv_dtype="float32",
                          context_size=8192, now=1_700_000_000)
        with open(os.path.join(root, ns, f"{plan.sha1}.kv"), "wb") as fh:
            for buf in enc.buffers:
                fh.write(buf)
    return ns


def bench_scan(files: int) -> None:
    root = tempfile.mkdtemp(prefix="kvdisk-bench-")
    try:
        t0 = time.perf_counter()
        make_files(root, files)
        print(f"setup: wrote {files} files in {time.perf_counter() - t0:.1f} s")
        times = []
        for _ in range(3):
            store = Store(root, space_bytes=1 << 50)
            t0 = time.perf_counter()
            store.scan()
            times.append(time.perf_counter() - t0)
            assert len(store.index) == files
        best = min(times)
        print(f"scan {files} files (headers only, warm page cache): best {best:.2f} s, "
              f"median {statistics.median(times):.2f} s; target 2 s -> ratio {best / 2:.2f}")
        t0 = time.perf_counter()
        changed = store.refresh(store.namespaces()[0])
        print(f"refresh with nothing changed: {(time.perf_counter() - t0) * 1e3:.3f} ms "
              f"(re-listed: {changed})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bench_lookup(n_tokens: int) -> None:
    from vllm_kvdisk.index import Entry, Index

    rng = np.random.default_rng(1)
    pieces = [bytes(rng.integers(32, 127, rng.integers(1, 8)).tolist()) for _ in range(32000)]
    table = TokenTable(pieces)
    grid = Grid(2048, 32, 16)
    ids = rng.integers(0, 32000, n_tokens).tolist()  # a Python list, as vLLM hands it over
    index = Index()
    warm = Prompt(table, grid, ids)
    # A realistic index: the prompt's own chain up to 3/4 of its length, plus noise.
    for key in warm.keys[: len(warm.keys) * 3 // 4]:
        index.add(Entry("ns", key.sha1, key.tokens, None, 0, Reason.COLD, 0, 0, 0, 1,
                        warm.digest(key.tokens)))
    planner = Planner(index, grid)

    def timed(label: str, make_cache) -> None:
        times = []
        for _ in range(20):
            cache = make_cache()
            t0 = time.perf_counter()
            result = planner.lookup("ns", Prompt(table, grid, ids, cache=cache), n_tokens - 1)
            times.append(time.perf_counter() - t0)
            assert result.chain
        med = statistics.median(times) * 1e3
        print(f"lookup {n_tokens}-token prompt, {label}: best {min(times) * 1e3:.2f} ms, "
              f"median {med:.2f} ms; target 2 ms -> ratio {med / 2:.2f}")

    print(f"prompt: {len(warm.text)} bytes of text, {len(warm.keys)} grid keys")
    timed("first sight (no key cache)", lambda: None)
    previous_turn = ids[: n_tokens - 1000]

    def warmed() -> KeyCache:
        cache = KeyCache()
        Prompt(table, grid, previous_turn, cache=cache)  # the previous turn, seen before
        return cache

    timed("next turn (previous turn's keys cached, 1000 new tokens)", warmed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--prompt-tokens", type=int, default=131_072)
    args = ap.parse_args()
    bench_lookup(args.prompt_tokens)
    bench_scan(args.files)


if __name__ == "__main__":
    main()
