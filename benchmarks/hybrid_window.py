"""Sliding-window model: what the disk cache serves, and what it costs on disk.

A tiny Gemma 3 (fp32, window 256, 2 window groups + 1 full-attention group, built offline)
runs one multi-turn conversation (each turn: the previous prompt, the reply, a new user
message) three ways, side by side in one run:

* warm: vLLM's own prefix cache, no kvdisk: what a warm engine keeps;
* disk, hybrid manager on: kvdisk, the device cache emptied before every turn (every hit
  comes from disk), then a restarted engine replays the last turn;
* disk, hybrid manager off: the same, with vLLM's hybrid KV cache manager turned off, so
  every layer is stored at full length (what kvdisk did before it served hybrid models).

Prints cached / warm (overall, and the first turn after the restart), disk bytes per
cached token, the ratio on vs off, the time to the first token of the last prompt
restored from disk over a device-cache hit of it (median of 3, in the restarted engine),
and where the pages of the hybrid manager's files go: full-attention and window pages, the
window blocks each file stores, and the two floors (every checkpoint's end restorable: the
union of their windows; only the deepest one's: its window alone).
Run: ``python benchmarks/hybrid_window.py``
(starts five engines; about a minute on two cores).
"""

from __future__ import annotations

import glob
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm_kvdisk.core.format import GroupKind  # noqa: E402
from vllm_kvdisk.storage.fileread import read_meta  # noqa: E402
from vllm_kvdisk.testing.harness import engine, generate, random_prompt  # noqa: E402
from vllm_kvdisk.testing.tinymodel import GEMMA3_WINDOW, build_tiny_model  # noqa: E402

TURNS, USER_TOKENS, REPLY_TOKENS = 6, 400, 32
CFG = {"kv_cache_min_tokens": 128, "kv_disk_load_policy": "always"}


def conversation(
    llm, reset, turns: int = TURNS, user_tokens: int = USER_TOKENS, seed: int = 100
) -> list[tuple[list[int], list[int], int]]:
    """(prompt, reply, cached) per turn; ``reset`` empties the device cache first."""
    prompt, out = [], []
    for turn in range(turns):
        prompt = prompt + random_prompt(user_tokens, seed=seed + turn)
        if reset:
            reset(llm)
        reply, cached = generate(llm, prompt, max_tokens=REPLY_TOKENS)
        out.append((prompt, reply, cached))
        prompt = prompt + reply
    return out


def empty_device(llm) -> None:
    for _ in range(20):
        if llm.reset_prefix_cache() is not False:
            return
        generate(llm, [7, 8, 9], max_tokens=1)  # a step gives back held blocks
    raise RuntimeError("the device prefix cache could not be reset")


def disk_bytes(kv: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(kv, "*", "*.kv")))


def breakdown(kv: str) -> str:
    """Pages per group kind over every file, the window blocks per file (one window
    group's), and the window pages the two floors need."""
    metas = []
    for path in glob.glob(os.path.join(kv, "*", "*.kv")):
        fd = os.open(path, os.O_RDONLY)
        try:
            metas.append(read_meta(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    metas.sort(key=lambda m: m.header.tokens)
    full = window = 0
    per_file, union = [], set()
    for m in metas:
        wins = [g for g in m.payload.groups if g.kind == GroupKind.WINDOW]
        full += sum(g.layers * g.num_blocks for g in m.payload.groups if g.kind == GroupKind.FULL)
        window += sum(g.layers * g.num_blocks for g in wins)
        if wins:
            per_file.append(wins[0].num_blocks)
            bs, tokens = m.payload.layout.block_size, m.header.tokens
            first = max(0, tokens - wins[0].window + 1) // bs
            union |= set(range(first, tokens // bs))
    last = metas[-1]
    layers = sum(g.layers for g in last.payload.groups if g.kind == GroupKind.WINDOW)
    bs, tokens = last.payload.layout.block_size, last.header.tokens
    deepest = tokens // bs - max(0, tokens - GEMMA3_WINDOW + 1) // bs
    return (
        f"{len(metas)} files (tokens {' '.join(str(m.header.tokens) for m in metas)}); pages: "
        f"full-attention {full}, window {window} (blocks per file of a window group: "
        f"{' '.join(map(str, per_file))}); window pages every checkpoint's end needs (the "
        f"union of their windows): {len(union) * layers}; the deepest end's alone: "
        f"{deepest * layers}"
    )


def ttft(llm, prompt: list[int]) -> float:
    started = time.perf_counter()
    generate(llm, prompt, max_tokens=1)
    return time.perf_counter() - started


def restarted(
    model: str, kv: str, llm_args: dict, prompt: list[int]
) -> tuple[list[int], int, list[float]]:
    """A restarted engine on ``kv``: its reply to ``prompt`` and the tokens it cached, then
    the time to the first token of ``prompt`` restored from disk over a device-cache hit
    of it, three times."""
    with engine(model, kv, llm_args=llm_args, **CFG) as llm:
        reply, cached = generate(llm, prompt, max_tokens=REPLY_TOKENS)
        ratios = []
        for _ in range(3):
            empty_device(llm)
            disk = ttft(llm, prompt)
            ratios.append(disk / ttft(llm, prompt))  # the device holds it now
    return reply, cached, ratios


def run_disk(model: str, kv: str, hma: bool) -> tuple[list, int, int, float]:
    args = {} if hma else {"disable_hybrid_kv_cache_manager": True}
    with engine(model, kv, llm_args=args, **CFG) as llm:
        turns = conversation(llm, empty_device)
    reply, cached, ratios = restarted(model, kv, args, turns[-1][0])
    if reply != turns[-1][1]:
        raise SystemExit("the restarted engine's reply differs: not exact")
    if hma:
        print("hybrid manager on:", breakdown(kv))
    return turns, cached, disk_bytes(kv), statistics.median(ratios)


def main() -> int:
    root = tempfile.mkdtemp(prefix="kvdisk-hybrid-bench-")
    model = str(build_tiny_model(os.path.join(root, "gemma3"), arch="gemma3"))
    with engine(model, None) as llm:
        warm = conversation(llm, None)
        warm_restart = generate(llm, warm[-1][0], max_tokens=REPLY_TOKENS)[1]
    rows = {}
    for hma in (True, False):
        turns, cached_restart, nbytes, slower = run_disk(
            model, os.path.join(root, f"kv-{hma}"), hma
        )
        if [t[1] for t in turns] != [t[1] for t in warm]:
            raise SystemExit(f"hybrid manager {'on' if hma else 'off'}: replies differ from warm")
        cached = sum(t[2] for t in turns)
        rows[hma] = (cached, cached_restart, nbytes, slower)
    warm_cached = sum(t[2] for t in warm)
    covered = len(warm[-1][0]) // 128 * 128
    print(
        f"tiny Gemma 3, window {GEMMA3_WINDOW}, {TURNS} turns of +{USER_TOKENS} user "
        f"+{REPLY_TOKENS} reply tokens, last prompt {len(warm[-1][0])} tokens"
    )
    print(
        f"warm (vLLM prefix cache): {warm_cached} cached tokens over the turns, "
        f"{warm_restart} on the last turn replayed"
    )
    for hma, (cached, restart, nbytes, slower) in rows.items():
        print(
            f"disk, hybrid manager {'on ' if hma else 'off'}: "
            f"cached/warm {cached / warm_cached:.2f} "
            f"overall, {restart / warm_restart:.2f} on the first turn after a restart; "
            f"{nbytes} bytes on disk, {nbytes / max(1, restart):.0f} bytes per cached token; "
            f"TTFT disk restore / device hit {slower:.2f}"
        )
    on, off = rows[True][2] / max(1, rows[True][1]), rows[False][2] / max(1, rows[False][1])
    print(
        f"disk bytes per cached token, window groups at window length / every layer at full "
        f"length: {on / off:.2f} (1 of 3 layers is full attention: {1 / 3:.2f} plus the "
        f"window blocks of each checkpoint the one below it does not hold; prompt covered "
        f"{covered} tokens)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
