"""Typed, frozen configuration of the disk KV cache: the one list of every knob.

Each field of :class:`KVDiskConfig` carries its help text and minimum; from it derive
the command-line flag (``--`` + the name in kebab case: ds4-server's flag names), the
environment variable (``KVDISK_`` + the name without its ``kv_disk_``/``kv_`` prefix, in
capitals: ``KVDISK_DIR``, ``KVDISK_SPACE_MB``, ``KVDISK_CACHE_MIN_TOKENS``), the validation,
``vllm-kvdisk serve --help`` and the README's table (a test checks it).

Precedence, highest first: a key in ``kv_connector_extra_config`` (what ``vllm-kvdisk
serve`` builds from its flags), a ``KVDISK_*`` environment variable, the default.
:func:`load_config` rejects unknown keys, unknown ``KVDISK_*`` variables and bad values
with a message naming the key. Pure: imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LOAD_POLICIES = ("always", "auto")
# Standard library only, no import of the package: deploy/validate.sh loads this file alone.
TENANT_SOURCES = ("none", "api_key", "header")  # core.tenancy
ADMISSION_RULES = ("all", "repeat")  # core.writebudget
COMPRESSION_MODES = ("off", "auto", "zstd")  # core.codec
ENV_PREFIX = "KVDISK_"


class ConfigError(ValueError):
    """A configuration key or value a user gave is not acceptable."""


def knob(
    default: Any,
    help: str,
    *,
    minimum: int | None = None,
    choices: tuple[str, ...] | None = None,
    unit: str = "",
) -> Any:
    return field(
        default=default,
        metadata={"help": help, "minimum": minimum, "choices": choices, "unit": unit},
    )


@dataclass(frozen=True, slots=True)
class KVDiskConfig:
    """Every knob of the disk cache. Names follow ds4-server's flags in snake_case."""

    kv_disk_dir: str = field(metadata={"help": "directory that holds the .kv files (required)"})
    kv_disk_space_mb: int = knob(
        8192,
        "disk budget: checkpoints are evicted (leaves first) to stay below it",
        minimum=1,
        unit="MiB",
    )
    kv_disk_min_free_mb: int = knob(
        1024,
        "never let the cache push the file system's free "
        "space below this; a save that cannot fit is skipped",
        minimum=0,
        unit="MiB",
    )
    kv_cache_min_tokens: int = knob(512, "no checkpoint shorter than this", minimum=1)
    kv_cache_cold_max_tokens: int = knob(
        30000, "cold checkpoints (after a prompt's prefill) only up to this length", minimum=1
    )
    kv_cache_continued_interval_tokens: int = knob(
        10000,
        "a continued checkpoint each time computed tokens cross a multiple of this",
        minimum=1,
    )
    kv_cache_boundary_trim_tokens: int = knob(
        32,
        "grid positions are k*align - trim, rounded down to the KV block size (tails are "
        "not trimmed)",
        minimum=0,
    )
    kv_cache_boundary_align_tokens: int = knob(2048, "checkpoint grid step", minimum=1)
    kv_cache_tail_checkpoints: bool = knob(
        True,
        "also save at the block floor of n (the prompt for cold, prompt + generated for "
        "evict and shutdown) as a delta on the grid; off: exactly ds4's grid",
    )
    tool_memory_max_ids: int = knob(
        100000, "size of the tool-call replay map (LRU; 0 turns replay off)", minimum=0
    )
    tool_memory_max_mb: int = knob(
        256,
        "most memory the tool-call replay map holds (sampled text and token ids; LRU), and "
        "about the most each API server's tool-call log (ROOT/toolmap) grows to",
        minimum=1,
        unit="MiB",
    )
    kv_cache_reject_different_quant: bool = knob(
        False, "accepted for ds4 compatibility: a checkpoint of another KV dtype is always a miss"
    )
    trace: str | None = knob(
        None, "trace file: one line per hit, miss (with the reason), save, eviction, quarantine"
    )
    trace_max_mb: int = knob(
        64, "the trace file is rotated to FILE.1 past this size", minimum=1, unit="MiB"
    )
    trace_to_log: bool = knob(False, "also write every trace line to vLLM's log at INFO")
    kv_diagnose_excerpt_bytes: int = knob(
        0,
        "each response's kvdisk.divergence carries excerpts of this many bytes (at most "
        "1024) of the prompt and of the checkpoint it left, around the divergence; only a "
        "checkpoint of the request's own cache salt is compared. 0: no text, offsets only",
        minimum=0,
        unit="B",
    )
    kv_disk_io_threads: int = knob(4, "reader/writer threads per worker", minimum=1)
    kv_disk_staging_mb: int = knob(
        2048,
        "host staging buffers kept for reuse between copies (fresh memory is slow to touch)",
        minimum=0,
        unit="MiB",
    )
    kv_disk_staging_inflight_mb: int = knob(
        4096,
        "most host memory that saves in flight may hold (copied out, not yet written); "
        'past it a save is skipped (saves_skipped{reason="busy"}) rather than growing '
        "memory or stalling the engine",
        minimum=1,
        unit="MiB",
    )
    kv_disk_gil_switch_us: int = knob(
        500,
        "Python's GIL switch interval in the worker process (0 leaves Python's 5000): "
        "each system call of an I/O thread ends in a wait for the GIL that a busy engine "
        "loop holds up to this long",
        minimum=0,
        unit="us",
    )
    kv_disk_load_policy: str = knob(
        "auto",
        "auto: restore only what is cheaper to read than to recompute, from running "
        "estimates of this engine's load bandwidth and prefill speed; always: restore every "
        "hit",
        choices=LOAD_POLICIES,
    )
    kv_disk_write_mb_per_day: int = knob(
        0,
        "SSD wear cap: most MiB of checkpoint files this server writes per day (a bucket "
        "refilled continuously, holding one day's worth; a restart refills it); past it "
        'saves are skipped (saves_skipped{reason="write_budget"}); 0: no cap',
        minimum=0,
        unit="MiB",
    )
    kv_disk_admission: str = knob(
        "all",
        "which requests are written: all, or repeat: only a request whose first block an "
        "earlier request of its namespace also started with (a one-off prompt is never "
        "written; a conversation is, from its second turn on)",
        choices=ADMISSION_RULES,
    )
    kv_disk_compression: str = knob(
        "auto",
        "lossless compression of the pages on disk (byte planes + zstd, in chunks; exact; "
        "bf16 KV takes ~0.7 of its bytes): zstd always; auto on a host of 8 or more CPUs "
        "(on fewer, decoding slows restores more than the smaller reads speed them), until "
        "64 MiB of pages shrank by less than 1.05x (fp8 KV: raw files from then on); off: "
        "raw files (every build since format 2 reads them)",
        choices=COMPRESSION_MODES,
    )
    kv_disk_lock_timeout_s: int = knob(
        10,
        "longest wait for the cache directory's lock (a stuck network volume then skips a save)",
        minimum=1,
        unit="s",
    )
    kv_tenant_from: str = knob(
        "api_key",
        "where a request's tenant comes from: its API key (Authorization: Bearer), the "
        "header --kv-tenant-header (set by a gateway), or none; each tenant gets its own "
        "cache_salt, so tenants share neither device nor disk cache (needs the kvdisk "
        "endpoint plugin, which vllm-kvdisk serve enables)",
        choices=TENANT_SOURCES,
    )
    kv_tenant_header: str = knob(
        "x-tenant-id", "the header naming the tenant when --kv-tenant-from is header"
    )
    kv_tenant_required: bool = knob(
        False,
        "refuse (HTTP 400) a generation request that names neither a tenant nor a cache_salt",
    )
    kv_disk_max_namespaces: int = knob(
        4096,
        "most namespaces (model x layout x LoRA adapter x cache salt) in the cache "
        "directory; a save that would make one more is skipped "
        '(saves_skipped{reason="namespace_cap"}); empty ones are removed at start-up',
        minimum=1,
    )
    kv_disk_namespace_share_pct: int = knob(
        0,
        "each namespace's share of the disk budget (0: none): when room is needed, the "
        "checkpoints of namespaces holding more than their share go first, so one tenant "
        "(cache salt) cannot flush the others",
        minimum=0,
        unit="%",
    )
    kv_disk_pin_share_pct: int = knob(
        10,
        "most of the disk budget that checkpoints pinned by requests (kvdisk.pin_s) may "
        "keep from eviction; pins past it are not honoured, latest expiry first (0: "
        "pins are refused)",
        minimum=0,
        unit="%",
    )
    kv_disk_allow_shared_dir: bool = knob(
        False,
        "accept a cache directory writable by its group/everyone or owned by another "
        "user (anyone who can write there can plant checkpoints)",
    )
    kv_object_url: str | None = knob(
        None,
        "s3://BUCKET/PREFIX: a second tier behind the directory, shared by replicas without a "
        "shared volume (saves are uploaded behind the engine's back; a lookup the disk cannot "
        "serve fetches the chain from there); endpoint and credentials from the AWS variables "
        "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...); needs the object extra (boto3)",
    )
    kv_object_deadline_s: int = knob(
        10,
        "longest a request waits for a fetch from the object store (listing, downloads, "
        "checks) before it is answered without it",
        minimum=1,
        unit="s",
    )

    @property
    def space_bytes(self) -> int:
        return self.kv_disk_space_mb * 1024 * 1024

    @property
    def min_free_bytes(self) -> int:
        return self.kv_disk_min_free_mb * 1024 * 1024


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(KVDiskConfig)}


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_of(name: str) -> str:
    short = name.removeprefix("kv_disk_").removeprefix("kv_")
    return ENV_PREFIX + short.upper()


ENV_NAMES = {env_of(name): name for name in FIELDS}


def default_of(name: str) -> Any:
    f = FIELDS[name]
    return None if f.default is dataclasses.MISSING else f.default


def _coerce(name: str, value: Any) -> Any:
    """Turn one user value into the field's type, or raise ConfigError naming the key."""
    f = FIELDS[name]
    kind = f.type
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if kind == "int":
        # bool is an int subclass; floats would silently truncate (no "8.5 GB" budgets).
        if isinstance(value, (bool, float)):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
        low = f.metadata.get("minimum")
        if low is not None and number < low:
            raise ConfigError(f"{name}: must be >= {low}, got {number}")
        return number
    if value is None and kind == "str | None":
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name}: expected a non-empty string, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def from_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """Config keys given as ``KVDISK_*`` variables; an unknown one is an error (a typo
    would otherwise be silently ignored)."""
    out = {}
    for var, value in environ.items():
        if not var.startswith(ENV_PREFIX):
            continue
        if var not in ENV_NAMES:
            raise ConfigError(
                f"unknown environment variable {var}; known: {', '.join(sorted(ENV_NAMES))}"
            )
        out[ENV_NAMES[var]] = value
    return out


def load_config(
    values: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> KVDiskConfig:
    """Build the config from a mapping, then ``KVDISK_*`` variables of ``environ`` for keys
    the mapping lacks; unknown keys and bad values raise ConfigError."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        known = ", ".join(sorted(FIELDS))
        raise ConfigError(f"unknown kvdisk config key(s) {', '.join(unknown)}; known keys: {known}")
    merged = {**from_environment(environ or {}), **values}
    if "kv_disk_dir" not in merged:
        raise ConfigError(
            "kv_disk_dir is required (--kv-disk-dir or KVDISK_DIR): the "
            "directory that holds the .kv files"
        )
    kwargs = {name: _coerce(name, value) for name, value in merged.items()}
    kwargs["kv_disk_dir"] = os.path.abspath(os.path.expanduser(kwargs["kv_disk_dir"]))
    if kwargs.get("kv_object_url"):
        from vllm_kvdisk.core.objects import ObjectUrl

        try:
            ObjectUrl.parse(kwargs["kv_object_url"])
        except ValueError as exc:
            raise ConfigError(f"kv_object_url: {exc}") from None
    config = KVDiskConfig(**kwargs)
    if config.kv_disk_namespace_share_pct > 100:
        raise ConfigError(
            f"kv_disk_namespace_share_pct: at most 100, got {config.kv_disk_namespace_share_pct}"
        )
    if config.kv_disk_pin_share_pct > 100:
        raise ConfigError(f"kv_disk_pin_share_pct: at most 100, got {config.kv_disk_pin_share_pct}")
    if config.kv_cache_boundary_trim_tokens >= config.kv_cache_boundary_align_tokens:
        raise ConfigError(
            "kv_cache_boundary_trim_tokens must be smaller than kv_cache_boundary_align_tokens "
            f"({config.kv_cache_boundary_trim_tokens} >= {config.kv_cache_boundary_align_tokens})"
        )
    return config


def as_dict(config: KVDiskConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in FIELDS}


def markdown_table() -> str:
    """The README's table of knobs (a test checks the README carries exactly this)."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for name, f in FIELDS.items():
        default = default_of(name)
        if name == "kv_disk_dir":
            shown = "required"
        elif isinstance(default, bool):
            shown = "on" if default else "off"
        else:
            shown = "none" if default is None else f"{default}"
        unit = f.metadata.get("unit") or ""
        shown += (
            f" {unit}" if unit and default is not None and not isinstance(default, bool) else ""
        )
        flag = flag_of(name) + (" / --no-…" if f.type == "bool" else "")
        rows.append(f"| `{flag}` | `{env_of(name)}` | {shown} | {f.metadata['help']} |")
    return "\n".join(rows)
