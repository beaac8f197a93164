"""Gated-DeltaNet hybrid: what the disk cache serves, next to vLLM's own prefix cache.

A tiny Qwen3-Next (bf16: 2 Gated-DeltaNet layers + 2 full-attention layers, vLLM's Mamba
"align" mode, block 640, built offline) runs one multi-turn conversation (each turn: the
previous prompt, the reply, a new user message) two ways, side by side in one run:

* warm: vLLM's own prefix cache, no kvdisk: what a warm engine keeps (it keeps a state at
  the prompt's last whole block, so a turn resumes there);
* disk: kvdisk, the device cache emptied before every turn (every hit comes from disk),
  then a restarted engine replays the last turn.

Prints cached / warm (overall, and the first turn after the restart), whether every reply
equals the warm run's (a disk hit lands where vLLM's own hit lands, so they must), disk
bytes per cached token, and the time to the first token of the last prompt restored from
disk over a device-cache hit of it (median of 3, in the restarted engine).
Run: ``python benchmarks/hybrid_state.py`` (four engines; about two minutes on two cores).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from hybrid_window import CFG, REPLY_TOKENS, disk_bytes, empty_device, restarted  # noqa: E402
from hybrid_window import conversation as window_conversation  # noqa: E402

from vllm_kvdisk.testing.harness import engine, generate  # noqa: E402
from vllm_kvdisk.testing.tinymodel import build_tiny_model  # noqa: E402

TURNS, USER_TOKENS, BLOCK = 6, 700, 640
ARGS = {"dtype": "bfloat16"}


def conversation(llm, reset) -> list[tuple[list[int], list[int], int]]:
    """(prompt, reply, cached) per turn; ``reset`` empties the device cache first."""
    return window_conversation(llm, reset, TURNS, USER_TOKENS, seed=200)


def main() -> int:
    root = tempfile.mkdtemp(prefix="kvdisk-state-bench-")
    model = str(build_tiny_model(os.path.join(root, "qwen3next"), arch="qwen3next"))
    with engine(model, None, llm_args=ARGS) as llm:
        warm = conversation(llm, None)
        # the last prompt again: a device hit where the restarted disk run's hit lands
        warm_reply, warm_restart = generate(llm, warm[-1][0], max_tokens=REPLY_TOKENS)
    kv = os.path.join(root, "kv")
    with engine(model, kv, llm_args=ARGS, **CFG) as llm:
        disk = conversation(llm, empty_device)
    last = warm[-1][0]
    reply, restart, ratios = restarted(model, kv, ARGS, last)
    same = [t[1] for t in disk] == [t[1] for t in warm] and reply == warm_reply
    warm_cached, disk_cached = sum(t[2] for t in warm), sum(t[2] for t in disk)
    nbytes = disk_bytes(kv)
    print(
        f"tiny Qwen3-Next (bf16, 2 Gated-DeltaNet + 2 full-attention layers, block {BLOCK}), "
        f"{TURNS} turns of +{USER_TOKENS} user +{REPLY_TOKENS} reply tokens, last prompt "
        f"{len(last)} tokens"
    )
    print(
        f"cached tokens per turn, warm (vLLM prefix cache): {[t[2] for t in warm]}; "
        f"disk (device emptied before every turn): {[t[2] for t in disk]}"
    )
    print(
        f"cached/warm {disk_cached / max(1, warm_cached):.2f} overall, "
        f"{restart / max(1, warm_restart):.2f} on the first turn after a restart "
        f"({restart} of {warm_restart} tokens)"
    )
    print(f"replies equal to the warm run's, every turn and after the restart: {same}")
    print(
        f"{nbytes} bytes on disk, {nbytes / max(1, restart):.0f} bytes per cached token "
        f"(attention: 2 layers x 512 B per token; states: one page of 320 KiB per "
        f"Gated-DeltaNet layer per checkpoint, {TURNS} checkpoints)"
    )
    print(
        f"TTFT disk restore / device hit {statistics.median(ratios):.2f} "
        f"(runs {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
