"""The core must import and work with vLLM and torch absent."""

import subprocess
import sys

CORE = ["config", "keys", "format", "index", "eviction", "budget", "saverules", "planner", "fsdir", "scan",
        "store", "verify", "cli", "trace", "control", "lifecycle", "identity", "diagnose",
        "policy", "replay", "replay.messages", "replay.memory", "replay.turns", "replay.log",
        "replay.ktm", "replay.capture", "staging", "logs", "tokens", "compat"]


def test_core_imports_without_vllm_or_torch():
    code = (
        "import sys\n"
        "for name in ('vllm', 'torch', 'transformers'):\n"
        "    sys.modules[name] = None  # any import of it now raises ImportError\n"
        + "".join(f"import vllm_kvdisk.{m}\n" for m in CORE)
        + "from vllm_kvdisk.cli import main\n"
        "assert main(['stats', '.']) == 0\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
