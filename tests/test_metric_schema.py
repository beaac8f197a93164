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


def test_every_label_set_is_exported_at_zero_from_the_start():
    """Right after a (re)start every series exists under every label set it can be counted
    under, at 0: a dashboard panel over a short window shows 0, not "No data", until the
    first save, miss or hit (``saves_total{reason}``, ``lookups_total{result,reason}``)."""
    import functools
    import types

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_kvdisk.ops.metrics import KVDiskPromMetrics, known_labels

    registry = CollectorRegistry()
    kinds = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = types.SimpleNamespace(kv_transfer_config=None)
    KVDiskPromMetrics(config, kinds, ["model_name", "engine"], {0: ["m", "0"]})
    exported = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                exported[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    known = known_labels()
    assert set(known) == {name for name, _kind, extra, *_ in METRICS if extra}
    for name, kind, extra, *_ in METRICS:
        if kind != "counter":
            continue
        for values in known.get(name, [()]):
            labels = {"model_name": "m", "engine": "0", **dict(zip(extra, values, strict=True))}
            key = (f"vllm:kvdisk_{name}_total", tuple(sorted(labels.items())))
            assert exported.get(key) == 0, key
    for reason in ("cold", "continued", "evict", "shutdown"):
        assert ("saves", (reason,)) in {(n, v) for n, vs in known.items() for v in vs}
    assert ("miss", "no_checkpoint") in known["lookups"] and ("hit", "") in known["lookups"]


def test_every_label_the_code_counts_is_a_known_label_set():
    """A label value counted somewhere but missing from ``known_labels`` would appear only
    once counted; the literals the code counts under are all known."""
    from vllm_kvdisk.ops.metrics import known_labels

    root = pathlib.Path(vllm_kvdisk.__file__).parent
    known = {
        (name, ":".join(values) if name == "lookups" else values[0])
        for name, sets in known_labels().items()
        for values in sets
    }
    counted = set()
    for path in root.rglob("*.py"):
        counted |= set(re.findall(r'count\("(\w+)", "([\w:]+)"[,)]', path.read_text()))
    assert counted and counted <= known, counted - known
