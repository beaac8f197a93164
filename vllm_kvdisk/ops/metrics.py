"""Metrics on vLLM's own ``/metrics``: ``vllm:kvdisk_*``, labelled like vLLM's metrics.

Both connector halves count into a ``StatsRecorder`` (``ops.recorder``); once per step vLLM
takes a :class:`KVDiskStats` snapshot from each worker and from the scheduler, aggregates
them, ships the dict to the API server, and calls :meth:`KVDiskPromMetrics.observe` there.
The series themselves are declared once, in ``ops.metricdefs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.index import Miss
from vllm_kvdisk.ops import recorder
from vllm_kvdisk.ops.metricdefs import HOOKS, LATENCY_BUCKETS, METRICS, OBJECT_OUTCOMES
from vllm_kvdisk.storage.budget import SKIP_REASONS

# Lookup outcomes without a reason; a miss carries its ``Miss`` label as the reason.
LOOKUP_RESULTS = ("hit", "device_hit", "load_failed")


def known_labels() -> dict[str, list[tuple[str, ...]]]:
    """Every label set each labelled series can be counted under (its extra labels),
    exported at 0 from the start: Prometheus' convention, so a panel or ``rate()`` over a
    short window after a restart shows 0 rather than "No data"."""
    lookups: list[tuple[str, ...]] = [(r, "") for r in LOOKUP_RESULTS]
    lookups.append(("hit", "object"))  # a hit whose files were fetched from the object store
    lookups += [("miss", m.label) for m in Miss]
    return {
        "lookups": lookups,
        "saves": [(r.name.lower(),) for r in Reason],
        "saves_skipped": [(r,) for r in SKIP_REASONS],
        "errors": [(h,) for h in HOOKS],
        "object_files": [(o,) for o in OBJECT_OUTCOMES],
    }


@dataclass
class KVDiskStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = recorder.empty()

    def aggregate(self, other: KVConnectorStats) -> KVDiskStats:
        recorder.aggregate(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return recorder.reduce(self.data)

    def is_empty(self) -> bool:
        return recorder.is_empty(self.data)


def snapshot(stats: recorder.StatsRecorder) -> KVDiskStats | None:
    """A connector half's ``get_kv_connector_stats``: what it counted since the last call."""
    data = stats.snapshot()
    return None if data is None else KVDiskStats(data=data)


class KVDiskPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        kinds = {
            "counter": self._counter_cls,
            "gauge": self._gauge_cls,
            "histogram": self._histogram_cls,
        }
        self._m: dict[str, Any] = {}
        for name, kind, extra, doc, _field in METRICS:
            kw: dict[str, Any] = {}
            if kind == "histogram":
                kw["buckets"] = list(LATENCY_BUCKETS)
            elif kind == "gauge":
                kw["multiprocess_mode"] = "mostrecent"
            # Named without the _total that Prometheus adds to counters (exported_name).
            self._m[name] = kinds[kind](
                name=f"vllm:kvdisk_{name}",
                documentation=doc,
                labelnames=list(labelnames) + list(extra),
                **kw,
            )
        # Export every series from the start (at 0), each labelled one under every label
        # set it can be counted under: alerts and rate() need them to exist.
        known = known_labels()
        for labels in per_engine_labelvalues.values():
            for name, _kind, extra, _doc, _field in METRICS:
                for values in known[name] if extra else [()]:
                    self._m[name].labels(*labels, *values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d, m = transfer_stats_data, self._m
        labels = self.per_engine_labelvalues[engine_idx]
        for name, kind, extra, _doc, field in METRICS:
            if field not in d:
                continue
            value = d[field]
            if kind == "gauge":
                m[name].labels(*labels).set(value)
            elif kind == "histogram":
                for seconds in value:
                    m[name].labels(*labels).observe(seconds)
            elif extra:
                for label, count in value.items():
                    # lookups' label is "result:reason"; the others carry one value.
                    values = label.split(":", len(extra) - 1)
                    values += [""] * (len(extra) - len(values))
                    m[name].labels(*labels, *values).inc(count)
            elif value:
                m[name].labels(*labels).inc(value)
