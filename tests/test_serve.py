"""``vllm-kvdisk serve``: the cache's flags beside vLLM's, and bad values refused (no engine:
the command exits before one starts)."""

import subprocess
import sys


def test_serve_help_lists_the_cache_flags_first_then_vllms(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "vllm_kvdisk.serve", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    ours, theirs = text.index("--kv-disk-dir"), text.index("usage: vllm serve")
    assert ours < theirs and "KVDISK_SPACE_MB" in text and "--no-kv-cache-tail-checkpoints" in text
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_kvdisk.serve",
            "serve",
            "m",
            "--kv-disk-dir",
            str(tmp_path),
            "--kv-disk-space-mb",
            "-3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "kv_disk_space_mb: must be >= 1" in bad.stderr
