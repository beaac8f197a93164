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


def test_serve_reserves_the_cores_vllm_reserves_without_a_connector():
    """vLLM's CPU backend keeps one more core per rank out of the workers' OpenMP threads
    when any KV connector is configured; the thread count alone changes bf16 results, so
    serve asks for vLLM's count without a connector (one per rank on x86, Arm, RISC-V)."""
    from vllm_kvdisk.serve import local_ranks, reserved_cpus

    assert local_ranks(["m"]) == 1
    assert local_ranks(["m", "-tp", "2", "--pipeline-parallel-size=2"]) == 4
    assert local_ranks(["m", "-tp2", "--tensor_parallel_size", "4"]) == 4  # the last one wins
    assert local_ranks(["m", "-tp", "2", "--nnodes", "2"]) is None  # vLLM's DP arithmetic
    assert reserved_cpus(["m"], {}, one_per_rank=True) == 1
    assert reserved_cpus(["m", "-tp", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, True) == 2
    assert reserved_cpus(["m", "-tp", "2"], {}, one_per_rank=False) == 1  # POWER, s390x
    # An explicit bind list or nobind reserves nothing; a value the user set wins.
    assert reserved_cpus(["m"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, True) is None
    assert reserved_cpus(["m"], {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, True) is None
    assert reserved_cpus(["m"], {"VLLM_CPU_NUM_OF_RESERVED_CPU": "3"}, True) is None


def test_serve_reads_the_parallel_sizes_from_a_config_file(tmp_path):
    from vllm_kvdisk.serve import _expand_config_file, local_ranks

    path = tmp_path / "serve.yaml"
    path.write_text("tensor-parallel-size: 2\npipeline_parallel_size: 3\n")
    args = _expand_config_file(["m", "--config", str(path), "-pp", "2"])
    assert local_ranks(args) == 4  # the command line wins over the file
