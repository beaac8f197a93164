"""Typed, frozen configuration of the disk KV cache.

One dataclass, built from a plain mapping (vLLM's ``kv_connector_extra_config`` or parsed
command-line flags) by :func:`load_config`, which rejects unknown keys and bad values with a
message naming the key. Pure: imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

LOAD_POLICIES = ("always", "auto")


class ConfigError(ValueError):
    """A configuration key or value a user gave is not acceptable."""


@dataclass(frozen=True, slots=True)
class KVDiskConfig:
    """Every knob of the disk cache. Names follow ds4-server's flags in snake_case."""

    kv_disk_dir: str
    kv_disk_space_mb: int = 8192
    # Never let the cache push the file system's free space below this.
    kv_disk_min_free_mb: int = 1024
    kv_cache_min_tokens: int = 512
    kv_cache_cold_max_tokens: int = 30000
    kv_cache_continued_interval_tokens: int = 10000
    kv_cache_boundary_trim_tokens: int = 32
    kv_cache_boundary_align_tokens: int = 2048
    tool_memory_max_ids: int = 100000
    kv_cache_reject_different_quant: bool = False
    trace: str | None = None
    kv_disk_io_threads: int = 4
    # Host staging buffers kept for reuse between copies (fresh memory is slow to touch).
    kv_disk_staging_mb: int = 2048
    kv_disk_load_policy: str = "auto"
    # Python's GIL switch interval in the worker process, in microseconds (0: leave it).
    # Every system call an I/O thread makes ends in a wait for the GIL, which a busy engine
    # thread keeps up to this long (Python's default: 5000). Measured in a CPU engine: a
    # 24 MB restore took 30-65 ms at 5000 us and 3-9 ms at 500 us.
    kv_disk_gil_switch_us: int = 500

    @property
    def space_bytes(self) -> int:
        return self.kv_disk_space_mb * 1024 * 1024

    @property
    def min_free_bytes(self) -> int:
        return self.kv_disk_min_free_mb * 1024 * 1024


_FIELDS = {f.name: f for f in dataclasses.fields(KVDiskConfig)}
_MINIMUM = {
    "kv_disk_space_mb": 1,
    "kv_disk_min_free_mb": 0,
    "kv_cache_min_tokens": 1,
    "kv_cache_cold_max_tokens": 1,
    "kv_cache_continued_interval_tokens": 1,
    "kv_cache_boundary_trim_tokens": 0,
    "kv_cache_boundary_align_tokens": 1,
    "tool_memory_max_ids": 0,
    "kv_disk_io_threads": 1,
    "kv_disk_staging_mb": 0,
    "kv_disk_gil_switch_us": 0,
}


def _coerce(name: str, value: Any) -> Any:
    """Turn one user value into the field's type, or raise ConfigError naming the key."""
    kind = _FIELDS[name].type
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if kind == "int":
        # bool is an int subclass; floats would silently truncate (no "8.5 GB" budgets).
        if isinstance(value, bool) or isinstance(value, float):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
        low = _MINIMUM.get(name, 0)
        if number < low:
            raise ConfigError(f"{name}: must be >= {low}, got {number}")
        return number
    if value is None and kind == "str | None":
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name}: expected a non-empty string, got {value!r}")
    return value


def load_config(values: Mapping[str, Any]) -> KVDiskConfig:
    """Build the config from a mapping; unknown keys and bad values raise ConfigError."""
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        known = ", ".join(sorted(_FIELDS))
        raise ConfigError(f"unknown kvdisk config key(s) {', '.join(unknown)}; known keys: {known}")
    if "kv_disk_dir" not in values:
        raise ConfigError("kv_disk_dir is required: the directory that holds the .kv files")
    kwargs = {name: _coerce(name, value) for name, value in values.items()}
    kwargs["kv_disk_dir"] = os.path.abspath(os.path.expanduser(kwargs["kv_disk_dir"]))
    config = KVDiskConfig(**kwargs)
    if config.kv_disk_load_policy not in LOAD_POLICIES:
        raise ConfigError(
            f"kv_disk_load_policy: expected one of {', '.join(LOAD_POLICIES)}, "
            f"got {config.kv_disk_load_policy!r}"
        )
    if config.kv_cache_boundary_trim_tokens >= config.kv_cache_boundary_align_tokens:
        raise ConfigError(
            "kv_cache_boundary_trim_tokens must be smaller than kv_cache_boundary_align_tokens "
            f"({config.kv_cache_boundary_trim_tokens} >= {config.kv_cache_boundary_align_tokens})"
        )
    return config
