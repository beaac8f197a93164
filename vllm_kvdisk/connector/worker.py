"""Worker half of the connector: copy pages out, write files, read files back.

Runs in each vLLM worker process; each method is the vLLM hook of the same name (the
connector facade delegates one line each). The engine step only enqueues work: a copy
thread gathers a save's pages into host staging after the step (on a GPU, on a side stream
behind an event recorded after the forward), a write pool encodes and writes them, and a
load pool of its own reads files back (``loading.Loads``), so a load never waits behind a
write or an fsync.

Invariants:
* A load verifies every file before using it (``restore.Restorer``). A file proven corrupt
  is quarantined; a sound file that is not what the index said (replaced, other ids) is
  only dropped from the index. Either way the blocks from it onward are reported as load
  errors (vLLM recomputes them) and the blocks before it stay valid.
* ``finished_sending`` only names requests whose blocks the scheduler held (``holds``),
  and only once no copy of theirs is running: their blocks are never reused under a copy.
  A preempted request's copies finish in ``handle_preemptions``, before the next forward.
* Staging held by saves in flight stays under ``kv_disk_staging_inflight_mb``; past it a
  save is skipped (``busy``), never waited for.
* A delta is written only while its parent is on disk: after the parent's write in this
  process, and checked again under the directory lock (``Store.write``). A save in flight
  is known by the namespace this worker writes (its KV shard's, not the job's ``plan.ns``,
  which is TP rank 0's) and its name: one text saved by two tenants at once is two saves.
* Nothing here raises into the engine: failures are counted, logged and reported.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from vllm_kvdisk.connector.guard import guarded
from vllm_kvdisk.connector.jobs import SaveJob, Scope, StepMeta, WorkerReport
from vllm_kvdisk.connector.loading import Loads
from vllm_kvdisk.connector.staging import StagingPool
from vllm_kvdisk.connector.threads import (
    CpuPlan,
    current_plan,
    pin,
    shorten_gil_switch,
    usable_cpus,
)
from vllm_kvdisk.connector.transfer import PageMover, block_pages, pinned_buffer, unique_layers
from vllm_kvdisk.core.codec import Choice
from vllm_kvdisk.core.compat import Placement
from vllm_kvdisk.core.config import KVDiskConfig
from vllm_kvdisk.core.encode import encode_plan
from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.format import GroupKind, has_state, is_hybrid
from vllm_kvdisk.core.keys import Fingerprint, Namespaces
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.ops.metrics import KVDiskStats, snapshot
from vllm_kvdisk.ops.recorder import StatsRecorder
from vllm_kvdisk.ops.trace import Trace
from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.objecttier import object_tier
from vllm_kvdisk.storage.store import Store

log = get_logger(__name__)

UPLOAD_AT_SHUTDOWN_S = 5.0  # how long a stopping worker lets its queued uploads finish


class WorkerSide:
    def __init__(
        self,
        config: KVDiskConfig,
        fingerprint: Fingerprint,
        block_size: int,
        placement: Placement | None = None,
    ):
        self.config = config
        self.stats = StatsRecorder()
        placement = Placement() if placement is None else placement
        self.placement = placement
        # A hybrid model (several KV cache groups, or sliding windows): each group's
        # layers have a block table of their own, and vLLM frees a window's blocks in
        # the step after the tokens past it are computed.
        self.groups = placement.groups
        self.hybrid = is_hybrid(self.groups)
        self._windows_copying = 0  # save copies whose window pages are not copied yet
        # Token counts are per engine: only its first worker counts them (bytes are per
        # rank, summed).
        self._counts_tokens = placement.tp_rank == 0 and placement.pp_rank == 0
        self.base_fp = fingerprint
        self.namespaces = Namespaces(fingerprint)
        self.block_size = block_size
        self.trace = Trace.from_config(config)
        self.store = Store.from_config(config, on_evict=self._on_evict, on_drop=self._on_drop)
        self.objects = object_tier(config, self.store)  # uploads what this rank saves
        # Loads never wait behind a save's write or fsync: each has its own threads. One
        # copy thread takes page copies off the engine step, in order. Their CPUs: threads.
        self._cpus = CpuPlan()  # known once vLLM bound this process (register_kv_caches)
        self.pool = ThreadPoolExecutor(
            config.kv_disk_io_threads,
            thread_name_prefix="kvdisk-write",
            initializer=lambda: pin(self._cpus.saves),
        )
        self._copier = ThreadPoolExecutor(
            1, thread_name_prefix="kvdisk-copy", initializer=lambda: pin(self._cpus.saves)
        )
        self.staging = StagingPool(config.kv_disk_staging_mb * 1024 * 1024)
        self.compression = Choice(config.kv_disk_compression, usable_cpus())
        log.info("kvdisk: %s", self.compression.describe())
        self.mover: PageMover | None = None
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._held: set[str] = set()  # finished requests whose pages were copied out
        # (namespace written, sha1) -> (written?, job): one text saved by two tenants (cache
        # salts) at once is two saves of one name in two namespaces
        self._inflight: dict[tuple[str, str], tuple[Future, SaveJob]] = {}
        self._copying: dict[str, int] = {}  # req id -> copies not finished
        self._copy_ended = threading.Condition(self._lock)
        self._staged = 0  # bytes of staging held by saves in flight
        self.staging_peak = 0  # the most _staged has been (a gauge: how near the cap)
        self._staging_cap = config.kv_disk_staging_inflight_mb << 20
        self._step: tuple[int, float] = (0, 0.0)  # (tokens, start) of the step in flight
        self._idle = True  # the step in flight computes nothing (kept past its timing)
        self.loads = Loads(
            store=self.store,
            stats=self.stats,
            trace=self.trace,
            namespaces=self.namespaces,
            block_size=block_size,
            io_threads=config.kv_disk_io_threads,
            counts_tokens=self._counts_tokens,
            by_request=self.hybrid,
            lock=self._lock,
            report=lambda: self._report,
            background=self.pool,
            pin=lambda: pin(self._cpus.loads),
        )

    # -- setup ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        place = self.placement
        missing = sorted(set(place.layer_names) - set(kv_caches))
        if missing:  # another stage's layers: its files would restore into the wrong layers
            raise ValueError(
                f"kvdisk: the KV caches registered lack {len(missing)} layer(s) "
                f"of this worker's KV cache config, e.g. {missing[0]}"
            )
        if has_state(self.groups):  # every layer as raw block pages (a state's views sit
            # inside each block's page, K/V block-outer beside them): transfer.block_pages
            names = place.group_layers or (place.layer_names,)
            layers = [
                block_pages(kv_caches[name], place.num_blocks) for group in names for name in group
            ]
        elif place.group_layers:  # one tensor per layer of each group, in group order: the
            # groups' views alias one allocation, so nothing may be de-duplicated
            layers = [kv_caches[name] for names in place.group_layers for name in names]
        else:
            layers = [t for _, t in unique_layers(kv_caches)]
        self.mover = PageMover(
            layers,
            self.block_size,
            self.base_fp.layout.split("/")[0],
            num_blocks=place.num_blocks,
            tp_rank=place.shard.index,
            tp_size=place.shard.count,
        )
        if self.mover.device.type == "cuda":
            self.staging.allocate = pinned_buffer  # device copies want page-locked memory
        self.loads.attach(self.mover, self.staging, self.groups)
        self.store.start()
        self._cpus = current_plan()
        shorten_gil_switch(self.config.kv_disk_gil_switch_us)
        log.info(
            "kvdisk worker: %d layers, page %d bytes, %d checkpoint(s) on disk",
            len(layers),
            self.mover.page_bytes,
            len(self.store.index),
        )

    def _on_drop(self, entry: Entry, why: str) -> None:
        with self._lock:
            self._report.removed.append((entry.ns, entry.sha1, entry.inode))
        self.trace.dropped(entry.sha1, entry.tokens, entry.size, why)

    def _mover(self) -> PageMover:
        """The page mover of the registered KV caches (none before ``register_kv_caches``)."""
        if self.mover is None:
            raise RuntimeError("kvdisk: no KV cache registered yet")
        return self.mover

    def _fp(self, scope: Scope) -> Fingerprint:
        return self.namespaces.fingerprint(scope.lora, scope.salt_digest)

    def _ns(self, scope: Scope) -> str:
        """The namespace this worker writes a scope's saves in: its own KV shard's (a
        job's ``plan.ns`` is TP rank 0's, where the scheduler plans)."""
        return self.namespaces.name(scope.lora, scope.salt_digest)

    def _on_evict(self, entry: Entry) -> None:
        self.stats.add("evictions")
        with self._lock:
            self._report.removed.append((entry.ns, entry.sha1, entry.inode))
        self.trace.evicted(entry.sha1, entry.tokens, entry.size)

    # -- loads (connector/loading.py) ---------------------------------------------------
    @guarded("start_load_kv", lambda: None)
    def start_load_kv(self, meta: StepMeta) -> None:
        self.loads.start(meta.loads)

    # -- step timing (for the cost-aware load policy) ---------------------------------
    def bind_connector_metadata(self, meta: StepMeta) -> None:
        self._step = (meta.step_tokens, time.perf_counter())
        self._idle = meta.step_tokens == 0

    def _step_computed(self) -> None:
        tokens, started = self._step
        if tokens:
            with self._lock:
                self._report.steps.append((tokens, time.perf_counter() - started))
        self._step = (0, 0.0)

    # -- saves ------------------------------------------------------------------------
    @guarded("wait_for_save", lambda: None)
    def wait_for_save(self, meta: StepMeta) -> None:
        """The forward is launched: time it, and hand this step's saves to the copy thread.
        Nothing here waits for a copy. Their blocks stay valid meanwhile: a running request
        keeps them, a finished one is held until finished_sending names it (``holds``),
        and a preempted one is flushed in ``handle_preemptions`` before the next forward."""
        self._step_computed()
        self._held.update(meta.holds)
        for job in meta.saves:
            if not self.placement.shard.writer:  # another rank holds and writes these pages
                self._confirm_copy(job.req_id)
                continue
            try:
                self._start_copy(job)
            except Exception as exc:  # noqa: BLE001 - this save alone is lost
                # Nothing of it was counted yet (``_start_copy``): it is reported failed
                # and confirmed, so its reservation and its request's hold end, and the
                # step's other saves still start.
                self.stats.count("errors", "wait_for_save")
                log.exception("kvdisk: starting the save %s failed", job.plan.sha1)
                self._save_failed(job, str(exc))
                self._confirm_copy(job.req_id)

    @guarded("handle_preemptions", lambda: None)
    def handle_preemptions(self, meta: StepMeta) -> None:
        """Before this step's forward: the blocks of requests preempted in it are free
        again, so their copies must be done before anything may write into them."""
        if self.hybrid:
            # The scheduler of this step may have freed window blocks a copy of the last
            # step reads (the window moved on); they are zeroed or written from here on.
            with self._copy_ended:
                self._copy_ended.wait_for(lambda: not self._windows_copying)
        if meta.flush:
            with self._copy_ended:
                self._copy_ended.wait_for(lambda: not self._copying.keys() & set(meta.flush))

    def _start_copy(self, job: SaveJob) -> None:
        """Hand one save to the copy thread. What may raise comes before anything is
        counted (staging, copies running, saves in flight): a save that raises here was
        never started."""
        mover = self._mover()
        nbytes = sum(len(ids) for ids in self._layer_ids(job)) * mover.page_bytes
        after = mover.mark()  # on a GPU: an event after this step's forward
        with self._lock:
            staged = self._staged
            busy = staged + nbytes > self._staging_cap
            if not busy:
                self._staged += nbytes
                self.staging_peak = max(self.staging_peak, self._staged)
                self._copying[job.req_id] = self._copying.get(job.req_id, 0) + 1
                self._windows_copying += bool(job.groups)
            ns = self._ns(job.scope)
            parent = self._inflight.get((ns, job.plan.parent)) if job.plan.parent else None
            done: Future = Future()
            if not busy:
                self._inflight[(ns, job.plan.sha1)] = (done, job)
        if busy:  # the disk is slower than the saves: skip one rather than grow memory
            self._save_failed(
                job,
                f"{staged >> 20} MiB of saves in flight, cap {self._staging_cap >> 20} MiB",
                "busy",
            )
            self._confirm_copy(job.req_id)
            return
        try:
            self._copier.submit(self._copy, job, nbytes, after, parent[0] if parent else None, done)
        except RuntimeError:  # shutting down
            if job.groups:
                self._windows_copied()
            self._copied(job.req_id)
            self._end_save(job, [], nbytes, done, False, "the worker is shutting down")

    def _copy(
        self, job: SaveJob, nbytes: int, after: Any, parent: Future | None, done: Future
    ) -> None:
        """Copy thread: the pages into staging (pinned memory is allocated here, never on
        the engine thread), then the write goes to the write pool."""
        mover = self._mover()
        pages: list[np.ndarray] = []
        windows_pending = bool(job.groups)
        try:
            layer_ids = self._layer_ids(job)
            pages = [self.staging.get(len(ids) * mover.page_bytes) for ids in layer_ids]
            if job.groups:
                # Window and state pages first: vLLM may free those blocks in the next
                # step (the engine waits for them in handle_preemptions); a running
                # request keeps its full-attention blocks.
                kinds = [g.kind for g in self.groups for _ in range(g.layers)]
                for freed_early in (True, False):
                    part = [i for i, k in enumerate(kinds) if (k != GroupKind.FULL) == freed_early]
                    mover.gather_layers(
                        [layer_ids[i] for i in part],
                        [pages[i] for i in part],
                        after=after,
                        layers=part,
                    )
                    if freed_early:
                        self._windows_copied()
                        windows_pending = False
            else:
                mover.gather(job.block_ids, pages, after=after)
        except Exception as exc:  # noqa: BLE001
            log.warning("kvdisk: copy-out for %s failed: %s", job.plan.sha1, exc)
            self._end_save(job, pages, nbytes, done, False, str(exc))
            return
        finally:
            if windows_pending:
                self._windows_copied()
            self._copied(job.req_id)  # its blocks may be given back now
        try:
            self.pool.submit(self._save, job, pages, nbytes, parent, done)
        except RuntimeError:  # shutting down
            self._end_save(job, pages, nbytes, done, False, "the worker is shutting down")

    def drain(self) -> None:
        """Wait until every save handed over so far is written, skipped or failed."""
        while True:
            with self._lock:
                pending = [done for done, _ in self._inflight.values()]
            if not pending:
                return
            wait(pending)

    def _copied(self, req_id: str) -> None:
        with self._copy_ended:
            left = self._copying.get(req_id, 0) - 1
            if left > 0:
                self._copying[req_id] = left
            else:
                self._copying.pop(req_id, None)
            self._report.copied.append(req_id)
            self._copy_ended.notify_all()

    def _windows_copied(self) -> None:
        with self._copy_ended:
            self._windows_copying -= 1
            self._copy_ended.notify_all()

    def _confirm_copy(self, req_id: str) -> None:
        """Tell the scheduler a save job of this request needs its blocks no more (each
        worker confirms each job once, copied or not)."""
        with self._lock:
            self._report.copied.append(req_id)

    def _end_save(
        self,
        job: SaveJob,
        pages: list[np.ndarray],
        nbytes: int,
        done: Future,
        ok: bool,
        why: str | None = None,
    ) -> None:
        """A save is over (written, skipped or failed): give back its memory, tell the
        children waiting on it."""
        if why is not None:
            self._save_failed(job, why)
        for buf in pages:
            self.staging.put(buf)
        with self._lock:
            self._inflight.pop((self._ns(job.scope), job.plan.sha1), None)
            self._staged -= nbytes
        done.set_result(ok)

    def _save_failed(self, job: SaveJob, why: str, skipped: str | None = None) -> None:
        if skipped:
            self.stats.count("saves_skipped", skipped)
        else:
            self.stats.add("save_failures")
        with self._lock:
            self._report.failed_saves.append((job.plan.ns, job.plan.sha1))
        self.trace.save_failed(job.plan.reason.name.lower(), job.plan.sha1, why, skipped)

    def _protected(self) -> set[tuple[str, str]]:
        """Files this process is about to extend: the parents of saves in flight."""
        with self._lock:
            return {
                (ns, j.plan.parent) for (ns, _), (_, j) in self._inflight.items() if j.plan.parent
            }

    def _save(
        self,
        job: SaveJob,
        pages: list[np.ndarray],
        nbytes: int,
        parent: Future | None,
        done: Future,
    ) -> None:
        ok = False
        try:
            ok = self._write(job, pages, parent)
        finally:
            self._end_save(job, pages, nbytes, done, ok)

    def _write(self, job: SaveJob, pages: list[np.ndarray], parent: Future | None) -> bool:
        plan = job.plan
        try:
            if parent is not None and not parent.result():
                self._save_failed(job, "its parent was not written", "parent_gone")
                return False
            t0 = time.perf_counter()
            fp = self._fp(job.scope)
            ns = self.store.ensure_namespace(fp)
            mover = self._mover()
            encoded = encode_plan(
                plan,
                text=job.text,
                ids=job.token_ids,
                layers=[p.data.cast("B") for p in pages],
                layout=mover.layout,
                fingerprint=fp.digest(),
                kv_dtype=mover.layout.dtype,
                context_size=job.context_size,
                now=int(time.time()),
                tool_map=job.tool_map,
                groups=self.groups,
                compress=self.compression.compress(),
            )
            entry = self.store.write(ns, plan.sha1, encoded, protect=self._protected())
        except SaveSkipped as exc:
            self._save_failed(job, exc.detail, exc.reason)
            return False
        except Exception as exc:  # noqa: BLE001 - a failed save only costs a future miss
            log.warning("kvdisk: save of %s failed: %s", plan.sha1, exc)
            self._save_failed(job, str(exc))
            return False
        with self._lock:
            self._report.written.append(entry)
        if self.objects is not None:
            self.objects.saved(ns, plan.sha1)  # write-behind: queued, never waited for
        seconds = time.perf_counter() - t0
        self.stats.observe("save_seconds", seconds)
        self.stats.count("saves", plan.reason.name.lower())
        self.stats.add("bytes_written", entry.size)
        self.stats.add("page_bytes_decoded", encoded.raw_page_bytes)
        self.stats.add("page_bytes_stored", encoded.stored_page_bytes)
        if encoded.payload.packing is not None and self.compression.observe(
            encoded.raw_page_bytes, encoded.stored_page_bytes
        ):
            log.warning(
                "kvdisk: pages shrink by less than 1/21 under compression (%s KV?): "
                "writing raw files from now on (--kv-disk-compression auto)",
                mover.layout.dtype,
            )
        self.trace.saved(plan.reason.name.lower(), plan.sha1, plan.tokens, entry.size, seconds)
        log.debug(
            "kvdisk: saved %s tokens %d..%d of %s (%s), %.1f MB in %.1f ms",
            plan.sha1[:12],
            plan.parent_tokens,
            plan.tokens,
            job.req_id,
            plan.reason.name.lower(),
            entry.size / 1e6,
            seconds * 1e3,
        )
        return True

    # -- step results -----------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Not self._step: wait_for_save ended its timing before vLLM asks for results,
        # and an idle wait in a step that decodes other requests would slow them all.
        recving = self.loads.finished(idle=self._idle)
        # Held blocks go back once no copy of the request is running, however many steps
        # that took: only finished requests are held (request_finished), and an idle engine
        # runs empty steps back to back while it waits, so a copy may outlast any window of
        # steps (a request released only within 4 steps of finishing leaked its blocks and
        # kept the engine stepping, spinning both cores, for good).
        with self._lock:
            sending = {req for req in self._held if req not in self._copying}
        self._held -= sending
        return sending or None, recving or None

    def take_failed_recving(self) -> set[str]:
        return self.loads.take_failed_recving()

    def _layer_ids(self, job: SaveJob) -> list[list[int]]:
        """Each layer's engine block ids of a save, in file order."""
        if not job.groups:
            return [job.block_ids] * self._mover().layout.num_layers
        return [ids for group, ids in zip(self.groups, job.groups) for _ in range(group.layers)]

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loads.take_load_errors()

    @guarded("build_connector_worker_meta", lambda: None)
    def build_connector_worker_meta(self) -> WorkerReport | None:
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return report if report else None

    def get_kv_connector_stats(self) -> KVDiskStats | None:
        self.stats.set("pending_writes", len(self._inflight))
        self.stats.set("staging_peak_bytes", self.staging_peak)
        if self.objects is not None:
            self.objects.report_to(self.stats)
        return snapshot(self.stats)

    def shutdown(self) -> None:
        """Flush: every save already handed over is copied and written before we return."""
        self._copier.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        if self.objects is not None:
            self.objects.close(UPLOAD_AT_SHUTDOWN_S)  # the last saves' uploads, briefly
        self.loads.shutdown()
        self.trace.close()
        self.store.close()
