"""Metrics on vLLM's own ``/metrics``: ``vllm:kvdisk_*``, labelled like vLLM's metrics.

Both connector halves count into a :class:`StatsRecorder`; once per step vLLM takes a
:class:`KVDiskStats` snapshot from each worker and from the scheduler, aggregates them,
ships the dict to the API server, and calls :meth:`KVDiskPromMetrics.observe` there.
Counters travel as deltas, latencies as lists of observations, gauges as latest values.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_kvdisk.storage.budget import SKIP_REASONS
from vllm_kvdisk.core.logs import get_logger

log = get_logger(__name__)
T = TypeVar("T")

COUNTERS = ("tokens_looked_up", "tokens_loaded", "bytes_written", "bytes_read",
            "save_failures", "evictions", "quarantined")
LABELLED = ("lookups", "saves", "saves_skipped", "errors")  # dicts of label value -> count
SERIES = ("load_seconds", "save_seconds")
GAUGES = ("disk_bytes", "disk_files", "disk_budget_bytes", "pending_writes")
# The connector hooks that run guarded (the label values of vllm:kvdisk_errors_total).
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "request_finished", "update_connector_output", "reset_cache", "start_load_kv",
         "wait_for_save", "build_connector_worker_meta")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {name: 0 for name in COUNTERS}
    data.update({name: {} for name in LABELLED})
    data.update({name: [] for name in SERIES})
    return data


@dataclass
class KVDiskStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVDiskStats:
        o = other.data
        for name in COUNTERS:
            if name in o:
                self.data[name] = self.data.get(name, 0) + o[name]
        for name in LABELLED:
            mine = self.data.setdefault(name, {})
            for label, count in o.get(name, {}).items():
                mine[label] = mine.get(label, 0) + count
        for name in SERIES:
            self.data.setdefault(name, []).extend(o.get(name, []))
        for name in GAUGES:
            if name in o:
                self.data[name] = o[name]
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {name: d.get(name, 0) for name in COUNTERS}
        for name in LABELLED:
            for label, count in d.get(name, {}).items():
                out[f"{name}[{label}]"] = count
        for name in SERIES:
            values = d.get(name, [])
            if values:
                out[f"{name}_avg_ms"] = round(1000 * sum(values) / len(values), 2)
        for name in GAUGES:
            if name in d:
                out[name] = d[name]
        return out

    def is_empty(self) -> bool:
        d = self.data
        return (not any(d.get(n) for n in COUNTERS + LABELLED + SERIES)
                and not any(n in d for n in GAUGES))


class StatsRecorder:
    """Thread-safe accumulation between two snapshots (I/O threads record too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._data[name] += value

    def count(self, name: str, label: str, value: int = 1) -> None:
        with self._lock:
            table = self._data[name]
            table[label] = table.get(label, 0) + value

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            self._data[name].append(seconds)

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._data[name] = value

    def snapshot(self) -> KVDiskStats | None:
        with self._lock:
            data, self._data = self._data, _empty()
        stats = KVDiskStats(data=data)
        return None if stats.is_empty() else stats


def guarded(hook: str, default: Callable[[], T]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run a connector hook; on any exception count it (``errors{hook}`` on the object's
    ``stats``), log it, and return ``default()``: the engine never dies of the cache."""

    def wrap(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> T:
            try:
                return method(self, *args, **kwargs)
            except Exception:  # noqa: BLE001
                self.stats.count("errors", hook)
                log.exception("kvdisk: %s failed; serving without the disk cache", hook)
                return default()

        return run

    return wrap


class KVDiskPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._m: dict[str, Any] = {}

        def metric(kind: Any, name: str, doc: str, extra: tuple[str, ...] = (), **kw: Any) -> None:
            self._m[name] = kind(name=f"vllm:kvdisk_{name}", documentation=doc,
                                 labelnames=list(labelnames) + list(extra), **kw)

        c, g, h = self._counter_cls, self._gauge_cls, self._histogram_cls
        metric(c, "lookups", "Disk cache lookups by result (hit, device_hit, miss) and miss "
               "reason.", ("result", "reason"))
        metric(c, "prompt_tokens_looked_up", "Prompt tokens of requests looked up on disk.")
        metric(c, "tokens_loaded", "Prompt tokens restored from disk instead of recomputed.")
        metric(c, "saves", "Checkpoints written, by save reason.", ("reason",))
        metric(c, "save_failures", "Checkpoint writes that failed (the prefix stays uncached).")
        metric(c, "saves_skipped", "Checkpoints not written for no fault: no_space (the budget "
               "or free-space watermark cannot be met), lock_timeout, parent_gone, "
               "namespace_removed, exists (a file of that name is on disk), busy (saves in "
               "flight hold the staging cap).", ("reason",))
        metric(c, "errors", "Exceptions a connector hook caught (the request was served "
               "without the cache).", ("hook",))
        metric(c, "bytes_written", "Bytes of checkpoint files written.")
        metric(c, "bytes_read", "Bytes of checkpoint files read for restores.")
        metric(c, "evictions", "Checkpoint files evicted for the budget or the free-space "
               "watermark.")
        metric(c, "quarantined_files", "Corrupt, truncated or foreign files moved to quarantine.")
        metric(h, "load_seconds", "Time to restore one request's chain from disk.",
               buckets=list(LATENCY_BUCKETS))
        metric(h, "save_seconds", "Time to encode, write and fsync one checkpoint.",
               buckets=list(LATENCY_BUCKETS))
        metric(g, "disk_bytes", "Bytes of checkpoint files in the cache directory.",
               multiprocess_mode="mostrecent")
        metric(g, "disk_files", "Checkpoint files in the cache directory.",
               multiprocess_mode="mostrecent")
        metric(g, "disk_budget_bytes", "The configured byte budget (kv_disk_space_mb).",
               multiprocess_mode="mostrecent")
        metric(g, "pending_writes", "Checkpoints copied out and not yet on disk.",
               multiprocess_mode="mostrecent")
        # Export every series from the start (at 0): alerts and rate() need them to exist.
        for labels in per_engine_labelvalues.values():
            for name, m in self._m.items():
                if name not in LABELLED:
                    m.labels(*labels)
            for reason in SKIP_REASONS:
                self._m["saves_skipped"].labels(*labels, reason)
            for hook in HOOKS:
                self._m["errors"].labels(*labels, hook)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d, m = transfer_stats_data, self._m
        labels = self.per_engine_labelvalues[engine_idx]
        for label, count in d.get("lookups", {}).items():
            result, _, reason = label.partition(":")
            m["lookups"].labels(*labels, result, reason).inc(count)
        for name, key in (("tokens_looked_up", "prompt_tokens_looked_up"),
                          ("tokens_loaded", "tokens_loaded"), ("bytes_written", "bytes_written"),
                          ("bytes_read", "bytes_read"), ("save_failures", "save_failures"),
                          ("evictions", "evictions"), ("quarantined", "quarantined_files")):
            if d.get(name):
                m[key].labels(*labels).inc(d[name])
        for name in ("saves", "saves_skipped", "errors"):
            for label, count in d.get(name, {}).items():
                m[name].labels(*labels, label).inc(count)
        for name in SERIES:
            for seconds in d.get(name, []):
                m[name].labels(*labels).observe(seconds)
        for name in GAUGES:
            if name in d:
                m[name].labels(*labels).set(d[name])


METRIC_NAMES = (
    "vllm:kvdisk_lookups_total", "vllm:kvdisk_prompt_tokens_looked_up_total",
    "vllm:kvdisk_tokens_loaded_total", "vllm:kvdisk_saves_total",
    "vllm:kvdisk_save_failures_total", "vllm:kvdisk_saves_skipped_total",
    "vllm:kvdisk_errors_total", "vllm:kvdisk_bytes_written_total",
    "vllm:kvdisk_bytes_read_total", "vllm:kvdisk_evictions_total",
    "vllm:kvdisk_quarantined_files_total", "vllm:kvdisk_load_seconds",
    "vllm:kvdisk_save_seconds", "vllm:kvdisk_disk_bytes", "vllm:kvdisk_disk_files",
    "vllm:kvdisk_disk_budget_bytes", "vllm:kvdisk_pending_writes",
)
