"""What a store counts: one set of counters its parts (scanner, budget, quarantine) share,
read by the connector's metrics. Pure: standard library."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StoreStats:
    written: int = 0
    bytes_written: int = 0
    evicted: int = 0
    bytes_evicted: int = 0
    quarantined: int = 0
    write_failures: int = 0
    skipped_saves: int = 0
    unreadable: int = 0  # files skipped for an I/O error (tried again later)
