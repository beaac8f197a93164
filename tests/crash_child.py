"""A process the fault tests start, kill and compare: an in-process engine with the disk
cache that answers a list of prompts and records the answers.

    python tests/crash_child.py MODEL KV_DIR OUT.json SEED COUNT [config json]

Each prompt is sent twice with the device cache reset in between, so every second answer
comes from a disk restore (or a recompute, if the file is gone): either way it must equal
the no-cache answer. Answers are appended to OUT.json after each prompt.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine import CFG  # noqa: E402

from vllm_kvdisk.testing.harness import engine, generate, random_prompt  # noqa: E402


def prompts(seed: int, count: int) -> list[list[int]]:
    """Sessions that share a prefix (so deltas and branches form) and grow."""
    base = random_prompt(640, seed)
    return [base + random_prompt(300 + 97 * (i % 5), seed * 1000 + i) for i in range(count)]


def main() -> None:
    model, kv, out, seed, count = sys.argv[1:6]
    extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    answers: list[dict] = []
    with engine(model, kv, **{**CFG, **extra}) as llm:
        for i, prompt in enumerate(prompts(int(seed), int(count))):
            first, _ = generate(llm, prompt, max_tokens=8)
            llm.reset_prefix_cache()
            again, cached = generate(llm, prompt, max_tokens=8)
            answers.append({"i": i, "first": first, "again": again, "cached": cached})
            with open(out + ".tmp", "w") as fh:
                json.dump(answers, fh)
            os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
