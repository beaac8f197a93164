"""A restore inside the server against a raw read of the same files, many rounds.

    .venv/bin/python benchmarks/restore_beside.py [--tokens 10000] [--rounds 8]

engine_bench's part 4 on one prompt, with more rounds: an engine saves the prompt's
checkpoints, a fresh engine on the same directory (a restart) restores it ``--rounds``
times from the page cache (its device prefix cache reset before each), and right after
each restore the same files are read raw (4 threads, into a warm buffer), so both
reads see the machine at the same moment. Prints the median of raw/restore (target
>= 0.9) and every round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from common import close, make_llm, model_shape
from engine_bench import chain, kv_paths, loads_traced, raw_reads, timed_generate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # as engine_bench
    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    work = tempfile.mkdtemp(prefix="kvdisk-restore-beside-")
    try:
        model = str(
            build_tiny_model(
                os.path.join(work, "model"), shape=model_shape(args.hidden, args.layers)
            )
        )
        kv, trace_path = os.path.join(work, "kv"), os.path.join(work, "trace.log")
        prompt = np.random.default_rng(0).integers(10, 4000, args.tokens).tolist()
        first = make_llm(model, kv)
        timed_generate(first, [prompt], 1)
        close(first)
        llm = make_llm(model, kv, trace=trace_path)
        pool = ThreadPoolExecutor(4)
        paths, seen, rounds = kv_paths(kv), 0, []
        for _ in range(args.rounds):
            llm.reset_prefix_cache()  # every restore from disk, none from the device
            timed_generate(llm, [prompt], 1)
            loads, seen = loads_traced(trace_path, seen)
            if len(loads) != 1:
                print(f"   a round without exactly one traced restore: {loads}")
                continue
            sha1, seconds = loads[0]
            files = chain(paths, sha1)
            raw = raw_reads(files, pool, False, 1)
            rounds.append((raw / max(seconds, 1e-4), seconds, raw, len(files)))
        close(llm)
        pool.shutdown()
        if not rounds:
            raise SystemExit("no restore was traced")
        print(
            f"{args.tokens} tokens, {rounds[0][3]} file(s), {args.rounds} restores from the "
            f"page cache: raw/restore median {statistics.median(r[0] for r in rounds):.2f} "
            "(target >= 0.9)"
        )
        print(
            "   rounds (raw/restore, restore ms, raw ms): "
            + ", ".join(f"{q:.2f} {s * 1e3:.0f} {r * 1e3:.0f}" for q, s, r, _ in rounds)
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
