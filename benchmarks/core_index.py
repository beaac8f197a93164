"""Start-up scan of a large cache directory and lookup time for a long prompt.

    .venv/bin/python benchmarks/core_index.py [--files 100000] [--prompt-tokens 131072]

Targets: 100k files indexed in < 2 s from their first bytes; a lookup for a 128k-token
prompt against 100k indexed files in < 2 ms, first sight *and* next turn. A lookup is what
the scheduler does per new request: convert vLLM's list of ids, then walk the index from
the roots (a dict probe per file boundary, an xxh3 of the prompt's ids once) to the
deepest checkpoint at any block boundary, here through a 76-file chain (grid points and
tails) among 100k other files that share its 4096-token system prompt.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from vllm_kvdisk.core.encode import encode_plan
from vllm_kvdisk.core.entry import Entry, head_digest
from vllm_kvdisk.core.format import PageLayout, Reason
from vllm_kvdisk.core.index import Index
from vllm_kvdisk.core.keys import Fingerprint, as_token_array, token_digest
from vllm_kvdisk.core.planner import Planner, Prompt, SavePlan
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.storage.store import Store

LAYOUT = PageLayout("bench:LBHNC", 128, 1, (1, 128, 1), "float32")
FP = Fingerprint("bench", "0", "float32", LAYOUT.name, 128, 1, 0)


def make_files(root: str, count: int, text_bytes: int) -> int:
    """Write ``count`` small, valid checkpoints quickly (no fsync: setup, not the subject):
    roots of 128 tokens and deltas of 128 more on them, each with ``text_bytes`` of text.
    Returns how many files were written."""
    store = Store(root, space_bytes=1 << 50)
    ns = store.ensure_namespace(FP)
    table = TokenTable([bytes([65 + i % 26]) * max(1, text_bytes // 256) for i in range(256)])
    rng = np.random.default_rng(0)
    written = 0
    for _ in range(count // 2):
        prompt = Prompt(table, rng.integers(0, 256, 300))
        parent = None
        for start, end, reason in ((0, 128, Reason.COLD), (128, 256, Reason.EVICT)):
            plan = SavePlan(ns, prompt.sha1_at(end), end, parent, start, reason)
            enc = encode_plan(
                plan,
                text=prompt.text_upto(end),
                ids=prompt.ids,
                layers=[bytes(LAYOUT.page_bytes)],
                layout=LAYOUT,
                fingerprint=FP.digest(),
                kv_dtype="float32",
                context_size=8192,
                now=1_700_000_000,
            )
            with open(os.path.join(root, ns, f"{plan.sha1}.kv"), "wb") as fh:
                for buf in enc.buffers:
                    fh.write(buf)
            parent = plan.sha1
            written += 1
    return written


def bench_scan(files: int, text_bytes: int) -> None:
    root = tempfile.mkdtemp(prefix="kvdisk-bench-", dir=os.environ.get("KVDISK_BENCH_DIR"))
    try:
        t0 = time.perf_counter()
        n = make_files(root, files, text_bytes)
        print(
            f"setup: wrote {n} files (half roots, half deltas; {text_bytes} bytes of text "
            f"each) in {time.perf_counter() - t0:.1f} s"
        )
        times = []
        for _ in range(3):
            store = Store(root, space_bytes=1 << 50)
            t0 = time.perf_counter()
            store.scan()
            times.append(time.perf_counter() - t0)
            assert len(store.index) == n
        best = min(times)
        print(
            f"scan {n} files (first bytes only, warm page cache): best {best:.2f} s, "
            f"median {statistics.median(times):.2f} s; target 2 s for 100k -> ratio "
            f"{best / n * 1e5 / 2:.2f}"
        )
        t0 = time.perf_counter()
        changed = store.refresh(store.namespaces()[0])
        print(
            f"refresh with nothing changed: {(time.perf_counter() - t0) * 1e3:.3f} ms "
            f"(re-listed: {changed})"
        )
        t0 = time.perf_counter()
        store.refresh(store.namespaces()[0], force=True)
        print(
            f"re-listing with nothing new (a refresh within a timestamp tick of the last "
            f"change): {(time.perf_counter() - t0) * 1e3:.1f} ms"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bench_lookup(n_tokens: int, others: int) -> None:
    rng = np.random.default_rng(1)
    block = 16  # a GPU backend's block: the most block boundaries per prompt
    system = 4096
    ids = rng.integers(0, 32000, n_tokens).tolist()  # a Python list, as vLLM hands it over
    arr = as_token_array(ids)
    index = Index()

    def add(sha1: str, start: int, end: int, parent: str | None, seq: np.ndarray) -> None:
        index.add(
            Entry(
                "ns",
                sha1,
                end,
                parent,
                start,
                Reason.COLD,
                0,
                0,
                0,
                1,
                token_digest(seq[:end]),
                head_digest(seq, start, block),
            )
        )

    # The prompt's own chain: the system prompt, then a grid point every 2048 tokens and
    # a tail per turn between them, up to 3/4 of the prompt (the last quarter is new).
    ends = sorted(
        {
            system,
            *range(2048, n_tokens * 3 // 4, 2048),
            *range(2048 + 1000, n_tokens * 3 // 4, 2048),
        }
    )
    parent, start = None, 0
    for k, end in enumerate(ends):
        add(f"own{k}", start, end, parent, arr)
        parent, start = f"own{k}", end
    # 100k other sessions below the same system prompt, each one file, its own ids after it.
    other = arr.copy()
    for i in range(others):
        other[system : system + block] = rng.integers(0, 32000, block)
        add(f"o{i}", system, system + 2048, "own0", other)
    planner = Planner(index, block, lambda e, a, b: None)
    print(
        f"index: {len(index)} files; prompt {n_tokens} tokens; the deepest checkpoint at "
        f"{ends[-1]} through {len(ends)} files"
    )

    def timed(label: str, prompt_ids: list[int]) -> None:
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            result = planner.lookup("ns", as_token_array(prompt_ids), len(prompt_ids) - 1)
            times.append(time.perf_counter() - t0)
        assert result.tokens == ends[-1] and len(result.segments) == len(ends)
        med = statistics.median(times) * 1e3
        print(
            f"lookup {len(prompt_ids)}-token prompt, {label}: best {min(times) * 1e3:.2f} ms, "
            f"median {med:.2f} ms; target 2 ms -> ratio {med / 2:.2f}"
        )

    timed("first sight", ids)
    timed(
        "next turn (the previous turn + 1000 new tokens)",
        ids + rng.integers(0, 32000, 1000).tolist(),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--prompt-tokens", type=int, default=131_072)
    ap.add_argument("--text-bytes", type=int, default=512)
    args = ap.parse_args()
    bench_lookup(args.prompt_tokens, args.files)
    bench_scan(args.files, args.text_bytes)


if __name__ == "__main__":
    main()
