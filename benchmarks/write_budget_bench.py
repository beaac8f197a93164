"""The SSD write budget (--kv-disk-write-mb-per-day) with the offered writes above it: does
the cap hold, and what does it cost in hits? Both engines in one run.

    .venv/bin/python benchmarks/write_budget_bench.py [--sessions 6] [--turns 6] [--cap-share 0.3]

An agent-like workload on the wide random model (hidden 768, 8 layers, 12 KiB of KV per
token in fp32): ``--sessions`` conversations of ``--turns`` turns, each turn the whole
conversation so far plus ~400 new tokens, 32 tokens generated, sessions interleaved, the
device prefix cache reset between turns (the GPU cache evicted them: every turn's prefix
must come from disk). Run twice, each on a fresh engine and directory:
  1. uncapped: the bytes it writes are the offered write volume;
  2. capped at ``--cap-share`` of that volume per day. The bucket holds one day's bytes and
     starts full, so over a run of minutes the cap allows cap x (1 + elapsed / 1 day); the
     bytes written (the trace's saves) over that is the overshoot (target: <= 5%).
Beside each: prompt tokens served from disk / the tokens an ideal cache would serve (every
turn's previous conversation), during the run and for each session's last prompt after a
restart.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
from common import close, make_llm, model_shape

from vllm_kvdisk.ops import trace
from vllm_kvdisk.testing.harness import generate

DAY_S = 86400.0


def workload(sessions: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """Per session, the prompt of each turn (each the previous one plus its reply
    stand-in and ~400 new tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sessions):
        conv = rng.integers(10, 4000, 600).tolist()
        prompts = []
        for _ in range(turns):
            prompts.append(list(conv))
            conv += rng.integers(10, 4000, 32 + int(rng.integers(300, 500))).tolist()
        out.append(prompts)
    return out


def run(model: str, work: str, name: str, sessions, cap_mb: int) -> dict:
    kv = os.path.join(work, f"kv-{name}")
    trace_path = os.path.join(work, f"trace-{name}.log")
    llm = make_llm(model, kv, trace=trace_path, kv_disk_write_mb_per_day=cap_mb)
    cached = ideal = 0
    t0 = time.monotonic()
    try:
        for turn in range(len(sessions[0])):
            for prompts in sessions:
                llm.reset_prefix_cache()  # the device cache lost it: only the disk can serve
                _, hit = generate(llm, prompts[turn], max_tokens=32)
                cached += hit
                ideal += len(prompts[turn - 1]) // 128 * 128 if turn else 0
    finally:
        close(llm)  # a shutdown flushes pending saves (and may plan shutdown saves)
    elapsed = time.monotonic() - t0
    written = sum(e.bytes for e in trace.read(trace_path, kinds=["saved"]))
    llm = make_llm(model, kv)  # a restart: each session's last prompt, from disk only
    try:
        after = sum(generate(llm, s[-1], max_tokens=1)[1] for s in sessions)
    finally:
        close(llm)
    after_ideal = sum(len(s[-1]) // 128 * 128 for s in sessions)
    return {
        "written": written,
        "elapsed": elapsed,
        "hit": cached / max(1, ideal),
        "after": after / max(1, after_ideal),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--cap-share", type=float, default=0.3)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    work = tempfile.mkdtemp(prefix="kvdisk-write-budget-bench-")
    try:
        model = str(build_tiny_model(os.path.join(work, "model"), shape=model_shape(768, 8)))
        sessions = workload(args.sessions, args.turns)
        free = run(model, work, "uncapped", sessions, 0)
        cap_mb = max(1, round(free["written"] * args.cap_share / 2**20))
        capped = run(model, work, "capped", sessions, cap_mb)
        allowed = cap_mb * 2**20 * (1 + capped["elapsed"] / DAY_S)
        print(
            f"{args.sessions} sessions x {args.turns} turns, wide random model "
            f"(12 KiB of KV per token), device cache reset before every turn"
        )
        print(
            f"1. uncapped: wrote {free['written'] / 1e6:.1f} MB in {free['elapsed']:.0f} s "
            f"(the offered volume); disk hits / ideal {free['hit']:.3f} during the run, "
            f"{free['after']:.3f} after a restart"
        )
        print(
            f"2. capped at {cap_mb} MiB/day ({args.cap_share:.0%} of the offered volume): "
            f"wrote {capped['written'] / 1e6:.1f} MB in {capped['elapsed']:.0f} s against "
            f"{allowed / 1e6:.1f} MB allowed -> {capped['written'] / allowed:.3f} of the cap "
            f"(target <= 1.05); disk hits / "
            f"ideal {capped['hit']:.3f} during the run, {capped['after']:.3f} after a restart"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
