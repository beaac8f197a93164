"""The metrics' schema: every ``vllm:kvdisk_*`` series, its kind, labels and help, once.

Pure data. The exporter (``ops.metrics``) builds its Prometheus series from ``METRICS``,
the recorder (``ops.recorder``) keeps the fields they read, and the deployment checks
read ``METRICS`` (a literal) without importing the package.
"""

from __future__ import annotations

# Fields of a stats snapshot, by how they travel from the engine to the API server.
COUNTERS = (
    "tokens_looked_up",
    "tokens_loaded",
    "bytes_written",
    "bytes_read",
    "page_bytes_decoded",
    "page_bytes_stored",
    "save_failures",
    "evictions",
    "quarantined",
    "object_bytes_fetched",
)  # deltas
LABELLED = ("lookups", "saves", "saves_skipped", "errors", "objects")  # label value -> delta
# The outcomes of vllm:kvdisk_object_files_total (storage/objecttier.py counts them).
OBJECT_OUTCOMES = (
    "uploaded",
    "upload_exists",
    "upload_dropped",
    "upload_gone",
    "upload_retried",
    "upload_failed",
    "fetched",
    "fetch_skipped",
    "fetch_failed",
    "corrupt",
    "list_failed",
)
SERIES = ("load_seconds", "save_seconds")  # observations
GAUGES = (
    "disk_bytes",
    "disk_files",
    "disk_budget_bytes",
    "pending_writes",
    "staging_peak_bytes",
    "write_budget_left_bytes",
)  # latest values

# The connector hooks that run guarded (the label values of vllm:kvdisk_errors_total).
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
    "reset_cache",
    "start_load_kv",
    "wait_for_save",
    "handle_preemptions",
    "build_connector_worker_meta",
)
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

# (series name without prefix, kind, extra labels, help, the snapshot field it reads)
METRICS = (
    (
        "lookups",
        "counter",
        ("result", "reason"),
        "Disk cache lookups by result (hit, device_hit, miss) and miss reason; a hit whose "
        "files were fetched from the object store for it has reason object.",
        "lookups",
    ),
    (
        "prompt_tokens_looked_up",
        "counter",
        (),
        "Prompt tokens of requests looked up on disk.",
        "tokens_looked_up",
    ),
    (
        "tokens_loaded",
        "counter",
        (),
        "Prompt tokens restored from disk instead of recomputed.",
        "tokens_loaded",
    ),
    ("saves", "counter", ("reason",), "Checkpoints written, by save reason.", "saves"),
    (
        "save_failures",
        "counter",
        (),
        "Checkpoint writes that failed (the prefix stays uncached).",
        "save_failures",
    ),
    (
        "saves_skipped",
        "counter",
        ("reason",),
        "Checkpoints not written for no fault: no_space (the budget or free-space watermark "
        "cannot be met), lock_timeout, parent_gone, namespace_removed, exists (a file of that "
        "name is on disk), busy (saves in flight hold the staging cap), namespace_cap (a new "
        "namespace would pass kv_disk_max_namespaces), write_budget (the bytes per day are "
        "spent), admission (the admission rule did not admit the request).",
        "saves_skipped",
    ),
    (
        "errors",
        "counter",
        ("hook",),
        "Exceptions a connector hook caught (the request was served without the cache).",
        "errors",
    ),
    (
        "object_files",
        "counter",
        ("outcome",),
        "Files moved between the disk and the object store (--kv-object-url), by outcome: "
        "uploaded, upload_exists, upload_dropped (queue full), upload_gone, upload_retried "
        "(tried again after 5, 30, 120 s), upload_failed (after the last), "
        "fetched, fetch_skipped, fetch_failed, corrupt, list_failed.",
        "objects",
    ),
    (
        "object_bytes_fetched",
        "counter",
        (),
        "Bytes of checkpoint files fetched from the object store into the directory.",
        "object_bytes_fetched",
    ),
    ("bytes_written", "counter", (), "Bytes of checkpoint files written.", "bytes_written"),
    ("bytes_read", "counter", (), "Bytes of checkpoint files read for restores.", "bytes_read"),
    (
        "page_bytes_decoded",
        "counter",
        (),
        "Bytes of KV pages in the checkpoints written, before compression "
        "(kv_disk_compression; their ratio to page_bytes_stored is the compression ratio).",
        "page_bytes_decoded",
    ),
    (
        "page_bytes_stored",
        "counter",
        (),
        "Bytes the KV pages of the checkpoints written take on disk (compressed or raw).",
        "page_bytes_stored",
    ),
    (
        "evictions",
        "counter",
        (),
        "Checkpoint files evicted for the budget or the free-space watermark.",
        "evictions",
    ),
    (
        "quarantined_files",
        "counter",
        (),
        "Corrupt, truncated or foreign files moved to quarantine.",
        "quarantined",
    ),
    (
        "load_seconds",
        "histogram",
        (),
        "Time to restore one request's chain from disk.",
        "load_seconds",
    ),
    (
        "save_seconds",
        "histogram",
        (),
        "Time to encode, write and fsync one checkpoint.",
        "save_seconds",
    ),
    ("disk_bytes", "gauge", (), "Bytes of checkpoint files in the cache directory.", "disk_bytes"),
    ("disk_files", "gauge", (), "Checkpoint files in the cache directory.", "disk_files"),
    (
        "disk_budget_bytes",
        "gauge",
        (),
        "The configured byte budget (kv_disk_space_mb).",
        "disk_budget_bytes",
    ),
    (
        "pending_writes",
        "gauge",
        (),
        "Checkpoints copied out and not yet on disk.",
        "pending_writes",
    ),
    (
        "staging_peak_bytes",
        "gauge",
        (),
        "The most host staging memory saves in flight have held since start (the cap is "
        "kv_disk_staging_inflight_mb; past it saves are skipped as busy).",
        "staging_peak_bytes",
    ),
    (
        "write_budget_left_bytes",
        "gauge",
        (),
        "Bytes the write budget (kv_disk_write_mb_per_day) lets this server write now; 0 "
        "without a cap.",
        "write_budget_left_bytes",
    ),
)


def exported_name(name: str, kind: str) -> str:
    """The series' name on ``/metrics`` (Prometheus adds ``_total`` to counters)."""
    return f"vllm:kvdisk_{name}" + ("_total" if kind == "counter" else "")


METRIC_NAMES = tuple(exported_name(name, kind) for name, kind, *_ in METRICS)
