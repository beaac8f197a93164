"""Counting between two snapshots: the recorder both connector halves count into.

Pure: a snapshot is a plain dict of the fields in ``ops.metricdefs`` (counters travel as
deltas, latencies as lists of observations, gauges as latest values); ``ops.metrics``
wraps it in vLLM's stats type and aggregates it with ``aggregate`` and ``reduce``.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm_kvdisk.ops.metricdefs import COUNTERS, GAUGES, LABELLED, SERIES


def empty() -> dict[str, Any]:
    data: dict[str, Any] = {name: 0 for name in COUNTERS}
    data.update({name: {} for name in LABELLED})
    data.update({name: [] for name in SERIES})
    return data


def aggregate(mine: dict[str, Any], other: dict[str, Any]) -> None:
    """Fold ``other`` into ``mine``: counters add, observations extend, gauges replace."""
    for name in COUNTERS:
        if name in other:
            mine[name] = mine.get(name, 0) + other[name]
    for name in LABELLED:
        table = mine.setdefault(name, {})
        for label, count in other.get(name, {}).items():
            table[label] = table.get(label, 0) + count
    for name in SERIES:
        mine.setdefault(name, []).extend(other.get(name, []))
    for name in GAUGES:
        if name in other:
            mine[name] = other[name]


def reduce(d: dict[str, Any]) -> dict[str, int | float]:
    """The flat summary vLLM logs (labelled counts as ``name[label]``, mean latencies)."""
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


def is_empty(d: dict[str, Any]) -> bool:
    return not any(d.get(n) for n in COUNTERS + LABELLED + SERIES) and not any(
        n in d for n in GAUGES
    )


class StatsRecorder:
    """Thread-safe accumulation between two snapshots (I/O threads record too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()

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

    def snapshot(self) -> dict[str, Any] | None:
        """What was counted since the last snapshot (None when nothing), and start over."""
        with self._lock:
            data, self._data = self._data, empty()
        return None if is_empty(data) else data
