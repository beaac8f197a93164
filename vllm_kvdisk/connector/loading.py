"""The worker's loads: each request's chain read back on threads of its own, and what
vLLM is told when it ends.

A load never queues behind a save's write or fsync: it has its own pool (and the readers
a restore fans out to). The outcome of each load reaches vLLM in the step it ends: the
request in ``finished_recving``, and what to recompute, as block ids (one KV cache group)
or as the whole request (several groups: vLLM cannot map their block ids back).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from vllm_kvdisk.connector.jobs import LoadJob, WorkerReport
from vllm_kvdisk.connector.restore import Restorer
from vllm_kvdisk.connector.staging import StagingPool
from vllm_kvdisk.connector.transfer import PageMover
from vllm_kvdisk.core.format import FormatError, Group
from vllm_kvdisk.core.keys import Namespaces
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.ops.recorder import StatsRecorder
from vllm_kvdisk.ops.trace import Trace
from vllm_kvdisk.storage.store import Store

log = get_logger(__name__)

IDLE_LOAD_WAIT_S = 0.005  # an empty step waits this long for a load to finish


class Loads:
    def __init__(
        self,
        *,
        store: Store,
        stats: StatsRecorder,
        trace: Trace,
        namespaces: Namespaces,
        block_size: int,
        io_threads: int,
        counts_tokens: bool,
        by_request: bool,
        lock: threading.Lock,
        report: Callable[[], WorkerReport],
        background: ThreadPoolExecutor,
        pin: Callable[[], None] = lambda: None,
    ):
        """``by_request``: report a short load as the whole request (several KV cache
        groups); ``report`` is the worker's report of this step (called under ``lock``);
        ``background`` takes hit-count updates off the restore's path."""
        self.store, self.stats, self.trace = store, stats, trace
        self.namespaces, self.block_size = namespaces, block_size
        self._counts_tokens, self._by_request = counts_tokens, by_request
        self._lock, self._report, self._background = lock, report, background
        # ``pin``: each thread's CPUs (connector/threads), set as it starts.
        self._pool = ThreadPoolExecutor(
            io_threads, thread_name_prefix="kvdisk-load", initializer=pin
        )
        self.readers = ThreadPoolExecutor(
            io_threads, thread_name_prefix="kvdisk-read", initializer=pin
        )
        self.restorer: Restorer | None = None
        self.pending: dict[str, tuple[Future, LoadJob]] = {}  # req id -> (bad blocks, job)
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()

    def attach(self, mover: PageMover, staging: StagingPool, groups: tuple[Group, ...]) -> None:
        """The KV caches are registered: loads can land in them."""
        self.restorer = Restorer(self.store, mover, staging, self.readers, self.block_size, groups)

    def start(self, jobs: list[LoadJob]) -> None:
        for job in jobs:
            try:
                self.pending[job.req_id] = (self._pool.submit(self.load, job), job)
            except RuntimeError:  # shutting down: recompute
                done: Future = Future()
                done.set_result(list(job.block_ids))
                self.pending[job.req_id] = (done, job)

    def load(self, job: LoadJob) -> list[int]:
        """Run one chain load; returns the block ids that could not be loaded."""
        if job.fail is not None or self.restorer is None:
            self.stats.count("lookups", "load_failed:")
            return list(job.block_ids)
        fp = self.namespaces.fingerprint(job.scope.lora, job.scope.salt_digest)
        ns = self.namespaces.name(job.scope.lora, job.scope.salt_digest)
        t0 = time.perf_counter()
        out = self.restorer.load(
            ns, fp.digest(), job, lambda sha1, why, inode: self._quarantine(ns, sha1, why, inode)
        )
        seconds = time.perf_counter() - t0
        self._touch_later(ns, out.used)
        self.stats.add("bytes_read", out.bytes_read)
        if out.failed is not None:
            planned = out.failed.inode if ns == job.indexed_ns else 0
            self._failed(ns, out.failed.sha1, planned, out.error, len(out.bad_blocks))
            return out.bad_blocks
        self.stats.observe("load_seconds", seconds)
        with self._lock:
            self._report().loads.append((out.bytes_read, seconds))
        if self._counts_tokens:
            self.stats.add("tokens_loaded", out.blocks * self.block_size)
        sha = job.files[-1].sha1 if job.files else "-"
        self.trace.loaded(sha, out.blocks * self.block_size, len(job.files), seconds)
        log.debug(
            "kvdisk: restored %d tokens of %s from %d file(s), %.1f MB in %.1f ms",
            out.blocks * self.block_size,
            job.req_id,
            len(job.files),
            out.bytes_read / 1e6,
            seconds * 1e3,
        )
        return []

    def _quarantine(self, ns: str, sha1: str, why: str, inode: int) -> None:
        if self.store.quarantine(ns, sha1, why, inode=inode or None):
            self.stats.add("quarantined")
            self.trace.quarantined(sha1, why)

    def _failed(self, ns: str, sha1: str, inode: int, exc: Exception | None, blocks: int) -> None:
        """Recompute from this file on; a corrupt one was quarantined already, a stale or
        unreadable one only leaves the index (the next refresh may find it again).
        ``inode``: the file the load was planned from (0: not known); a file saved under
        the name since stays."""
        self.stats.count("lookups", "load_failed:")
        if not isinstance(exc, FormatError):
            log.warning("kvdisk: load of %s skipped: %s", sha1, exc)
            self.store.forget(ns, sha1, inode or None)
        with self._lock:
            self._report().stale.append((ns, sha1, inode))
        self.trace.load_failed(sha1, str(exc), blocks)

    def _touch_all(self, ns: str, sha1s: list[str]) -> None:
        for sha1 in sha1s:
            self.store.touch(ns, sha1)

    def _touch_later(self, ns: str, sha1s: list[str]) -> None:
        """Hit counts and last-used times, off the restore's critical path."""
        if not sha1s:
            return
        try:
            self._background.submit(self._touch_all, ns, sha1s)
        except RuntimeError:  # shutting down: the pool takes no more work
            pass

    def finished(self, idle: bool) -> set[str]:
        """The requests whose load ended (``finished_recving``). ``idle``: the step in
        flight computes nothing, so wait a little for a load rather than let the engine
        spin through empty steps, which takes the cores the reads need (a request
        arriving meanwhile waits at most IDLE_LOAD_WAIT_S)."""
        if self.pending and idle:
            wait(
                [fut for fut, _ in self.pending.values()],
                timeout=IDLE_LOAD_WAIT_S,
                return_when=FIRST_COMPLETED,
            )
        recving = set()
        for req_id, (fut, job) in list(self.pending.items()):
            if fut.done():
                del self.pending[req_id]
                recving.add(req_id)
                try:
                    bad = fut.result()
                except Exception as exc:  # noqa: BLE001 - recompute everything it covered
                    log.warning("kvdisk: load for %s crashed: %s", req_id, exc)
                    bad = job.block_ids
                if bad:
                    if self._by_request:  # block ids are per group: vLLM takes the request
                        self._failed_recving.add(req_id)
                    else:
                        self._load_errors.update(bad)
                    with self._lock:  # in the same step as finished_recving
                        self._report().failed_loads.append(req_id)
        return recving

    def take_failed_recving(self) -> set[str]:
        """Requests whose load fell short, on a hybrid model: vLLM cannot map block ids of
        several groups back to requests, so the whole request is recomputed."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.readers.shutdown(wait=True)
