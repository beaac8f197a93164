"""The metrics' schema (ops.metricdefs) against the code that counts and exports."""

import pathlib
import re

import vllm_kvdisk
from vllm_kvdisk.ops import recorder
from vllm_kvdisk.ops.metricdefs import (
    COUNTERS,
    GAUGES,
    HOOKS,
    LABELLED,
    METRIC_NAMES,
    METRICS,
    SERIES,
)


def test_every_guarded_hook_has_its_errors_label():
    root = pathlib.Path(vllm_kvdisk.__file__).parent
    guarded = set()
    for path in root.rglob("*.py"):
        guarded |= set(re.findall(r'@guarded\("(\w+)"', path.read_text()))
    assert guarded and guarded <= set(HOOKS), guarded - set(HOOKS)


def test_every_series_reads_a_recorded_field_and_names_are_unique():
    fields = set(COUNTERS + LABELLED + SERIES + GAUGES)
    assert {field for *_, field in METRICS} == fields
    assert len(set(METRIC_NAMES)) == len(METRIC_NAMES) == len(METRICS)
    assert "vllm:kvdisk_lookups_total" in METRIC_NAMES
    assert "vllm:kvdisk_disk_bytes" in METRIC_NAMES  # gauges carry no _total


def test_recorder_snapshots_aggregate_and_reduce():
    r = recorder.StatsRecorder()
    assert r.snapshot() is None
    r.add("bytes_read", 10)
    r.count("lookups", "miss:no_file")
    r.observe("load_seconds", 0.5)
    r.set("disk_files", 0)  # a gauge at 0 is still news
    a = r.snapshot()
    assert r.snapshot() is None
    b = recorder.empty()
    b["bytes_read"], b["lookups"], b["disk_files"] = 5, {"miss:no_file": 2, "hit:": 1}, 7
    recorder.aggregate(a, b)
    assert a["bytes_read"] == 15 and a["lookups"] == {"miss:no_file": 3, "hit:": 1}
    assert a["disk_files"] == 7
    out = recorder.reduce(a)
    assert out["lookups[miss:no_file]"] == 3 and out["load_seconds_avg_ms"] == 500.0
