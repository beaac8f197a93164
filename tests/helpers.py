"""Small helpers shared by the test files (standard library only, no engine)."""

import glob
import os

from vllm_kvdisk.storage.quarantine import DIRNAME as QUARANTINE

# Plain English words that every Python install carries: prompts of a known length without
# a data file, the same on every machine.
WORDS = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py")).read().split()


def text(start: int, n: int) -> str:
    """``n`` words from word ``start`` on (wrapping every 2000 words)."""
    return " ".join(WORDS[start % 2000 : start % 2000 + n])


def kv_files(kv: str) -> list[str]:
    """The checkpoint files of every namespace under the root ``kv``, sorted; quarantined
    files are evidence, not checkpoints, and are left out."""
    return sorted(
        p
        for p in glob.glob(os.path.join(kv, "*", "*.kv"))
        if os.path.basename(os.path.dirname(p)) != QUARANTINE
    )


# A function tool the tests' chats offer (the hermes parser reads its calls).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        },
    },
}
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
