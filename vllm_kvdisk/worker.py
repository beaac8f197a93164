"""Worker half of the connector: copy pages out, write files, read files back.

Runs in each vLLM worker process. A thread pool does all file I/O; the engine step only
enqueues work, plus (for saves) one gather of the pages into host memory so that the
blocks are free for reuse as soon as the step ends (no race with preemption or reuse).

Invariants:
* A load verifies every file before using it: name = SHA1 of its text, expected token
  counts, same namespace digest and page layout, per-layer checksums. A file that fails is
  quarantined and the blocks from it onward are reported as load errors (vLLM recomputes
  them); the blocks before it stay valid.
* ``finished_sending`` only names requests whose blocks the scheduler held for a save.
* A delta is written only after its parent landed; if the parent failed, it is dropped.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from vllm_kvdisk.config import KVDiskConfig
from vllm_kvdisk.format import (FormatError, Meta, Payload, encode_checkpoint, pages_cached,
                                 read_layer_into, read_text)
from vllm_kvdisk.index import Entry
from vllm_kvdisk.jobs import LoadFile, LoadJob, SaveJob, Scope, StepMeta, WorkerReport
from vllm_kvdisk.keys import Fingerprint, token_digest
from vllm_kvdisk.metrics import KVDiskStats, StatsRecorder
from vllm_kvdisk.staging import StagingPool
from vllm_kvdisk.store import Store
from vllm_kvdisk.trace import Trace
from vllm_kvdisk.transfer import PageMover, pinned_buffer, unique_layers

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, config: KVDiskConfig, fingerprint: Fingerprint, block_size: int):
        self.config = config
        self.stats = StatsRecorder()
        # Token counts are per engine: only rank 0 counts them (bytes are per rank, summed).
        self._counts_tokens = fingerprint.tp_rank == 0
        self.base_fp = fingerprint
        self.block_size = block_size
        self.trace = Trace(config.trace)
        self.store = Store(config.kv_disk_dir, space_bytes=config.space_bytes,
                           min_free_bytes=config.min_free_bytes, on_evict=self._on_evict)
        self.pool = ThreadPoolExecutor(config.kv_disk_io_threads, thread_name_prefix="kvdisk-io")
        self.staging = StagingPool(config.kv_disk_staging_mb * 1024 * 1024)
        # Read-ahead for restores: one layer in flight while the previous one is scattered.
        self._readers = ThreadPoolExecutor(config.kv_disk_io_threads, thread_name_prefix="kvdisk-read")
        self.mover: PageMover | None = None
        self._lock = threading.Lock()
        self._report = WorkerReport()
        self._loads: dict[str, tuple[Future, LoadJob]] = {}
        self._load_errors: set[int] = set()
        self._held: set[str] = set()  # finished requests whose pages were copied out
        self._finished_seen: set[str] = set()
        self._inflight: dict[str, Future] = {}
        self._fps: dict[tuple[str, str], Fingerprint] = {}
        self._step: tuple[int, float] = (0, 0.0)  # (tokens, start) of the step in flight

    # -- setup ------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, Any]) -> None:
        layers = [t for _, t in unique_layers(kv_caches)]
        self.mover = PageMover(layers, self.block_size, self.base_fp.layout.split("/")[0])
        if self.mover.device.type == "cuda":
            self.staging.allocate = pinned_buffer  # device copies want page-locked memory
        self.store.scan()
        self._shorten_gil_switch()
        log.info("kvdisk worker: %d layers, page %d bytes, %d checkpoint(s) on disk",
                 len(layers), self.mover.page_bytes, len(self.store.index))

    def _shorten_gil_switch(self) -> None:
        want = self.config.kv_disk_gil_switch_us / 1e6
        if want and want < sys.getswitchinterval():
            log.info("kvdisk: GIL switch interval %.0f -> %.0f us, so I/O threads are not "
                     "starved by the engine loop", sys.getswitchinterval() * 1e6, want * 1e6)
            sys.setswitchinterval(want)

    def _fp(self, scope: Scope) -> Fingerprint:
        key = (scope.lora, scope.salt_digest)
        if key not in self._fps:
            self._fps[key] = Fingerprint(**{**self.base_fp.describe(), "lora": scope.lora,
                                            "salt_digest": scope.salt_digest})
        return self._fps[key]

    def _on_evict(self, entry: Entry) -> None:
        self.stats.add("evictions")
        with self._lock:
            self._report.removed.append((entry.ns, entry.sha1))
        self.trace.line(f"evicted sha1={entry.sha1} tokens={entry.tokens} bytes={entry.size}")

    # -- loads ------------------------------------------------------------------------
    def start_loads(self, meta: StepMeta) -> None:
        for job in meta.loads:
            self._loads[job.req_id] = (self.pool.submit(self._load, job), job)

    def _load(self, job: LoadJob) -> list[int]:
        """Run one chain load; returns the block ids that could not be loaded."""
        fp = self._fp(job.scope)
        ns = fp.dirname()
        t0 = time.perf_counter()
        loaded_blocks = 0
        read_bytes = 0
        used: list[str] = []
        for file in job.files:
            try:
                blocks, nbytes = self._load_file(ns, fp, file, job)
                loaded_blocks += blocks
                read_bytes += nbytes
                used.append(file.sha1)
            except Exception as exc:  # noqa: BLE001 - any failure means "recompute"
                self._touch_later(ns, used)
                self.stats.count("lookups", "load_failed:")
                if isinstance(exc, FormatError):
                    self.stats.add("quarantined")
                    self.store.quarantine(ns, file.sha1, str(exc))
                    with self._lock:
                        self._report.removed.append((ns, file.sha1))
                    self.trace.line(f"quarantined sha1={file.sha1} ({exc})")
                else:
                    log.warning("kvdisk: load of %s failed: %s", file.sha1, exc)
                first_bad = max(file.parent_tokens // self.block_size, job.start_block)
                bad = job.block_ids[first_bad - job.start_block:]
                self.trace.line(f"miss for sha1={file.sha1} (reason: load failed: {exc}; "
                                f"{len(bad)} block(s) will be recomputed)")
                return bad
        seconds = time.perf_counter() - t0
        self._touch_later(ns, used)
        self.stats.observe("load_seconds", seconds)
        with self._lock:
            self._report.loads.append((read_bytes, seconds))
        if self._counts_tokens:
            self.stats.add("tokens_loaded", loaded_blocks * self.block_size)
        ms = seconds * 1000
        sha = job.files[-1].sha1 if job.files else "-"
        self.trace.line(f"hit for sha1={sha} (loaded {loaded_blocks * self.block_size} tokens "
                        f"from {len(job.files)} file(s), {ms:.0f} ms)")
        return []

    def _touch_later(self, ns: str, sha1s: list[str]) -> None:
        """Hit counts and last-used times, off the restore's critical path (five system
        calls per file, each a wait for the GIL in a busy engine process)."""
        if not sha1s:
            return
        try:
            self.pool.submit(lambda: [self.store.touch(ns, sha1) for sha1 in sha1s])
        except RuntimeError:  # shutting down: the pool takes no more work
            pass

    def _load_file(self, ns: str, fp: Fingerprint, file: LoadFile, job: LoadJob) -> tuple[int, int]:
        """Restore one file's blocks; returns (blocks restored, bytes read)."""
        mover = self.mover
        if mover is None:
            raise RuntimeError("KV caches not registered")
        with self.store.open(ns, file.sha1) as (fd, meta, _):
            h, p = meta.header, meta.payload
            if (h.tokens, p.parent_tokens) != (file.tokens, file.parent_tokens):
                raise FormatError(f"file holds tokens [{p.parent_tokens}, {h.tokens}), "
                                  f"index said [{file.parent_tokens}, {file.tokens})")
            if p.fingerprint != fp.digest():
                raise FormatError("file belongs to another namespace (model/layout/salt)")
            if p.layout != mover.layout:
                raise FormatError(f"page layout {p.layout} != engine's {mover.layout}")
            if hashlib.sha1(read_text(fd, meta)).hexdigest() != file.sha1:
                raise FormatError("file name is not the SHA1 of its text")
            skip = max(0, job.start_block - p.first_block)
            first_target = p.first_block + skip - job.start_block
            targets = job.block_ids[first_target: first_target + p.num_blocks - skip]
            if len(targets) != p.num_blocks - skip:
                raise ValueError("load job has fewer target blocks than the file")
            if mover.host_resident:
                self._read_direct(fd, meta, skip, targets)
            else:
                self._read_staged(fd, meta, skip, targets)
            nbytes = meta.text_len + meta.offsets.layer_bytes * p.layout.num_layers
            self.stats.add("bytes_read", nbytes)
            return len(targets), nbytes

    def _read_direct(self, fd: int, meta: Meta, skip: int, targets: list[int]) -> None:
        """Host-resident cache: every layer is read straight into its blocks, no staging
        copy, one preadv per layer. Pages the device already holds (``skip``) are read into
        scratch only to verify the checksum; a layer's scratch goes back to the pool as
        soon as the layer is done, so few buffers are in use (fresh memory is slow to
        touch: holding one per layer until the end made restores after a restart 2-3x
        slower). A file in the page cache is read by all reader threads at once (one layer
        each); a cold one as one sequential stream in this thread. Returns only when every
        read has ended: a failed load's blocks are recomputed, and no straggler may write
        into them afterwards."""
        mover = self.mover
        scratch_bytes = skip * mover.page_bytes
        runs = mover.block_runs(targets)

        def one(layer: int) -> None:
            scratch = self.staging.get(scratch_bytes) if skip else None
            try:
                views = [memoryview(scratch)] if scratch is not None else []
                read_layer_into(fd, meta, layer, views + mover.host_views(layer, runs))
            finally:
                if scratch is not None:
                    self.staging.put(scratch)

        layers = range(meta.payload.layout.num_layers)
        if not pages_cached(fd, meta):
            for layer in layers:
                one(layer)
            return
        futures = [self._readers.submit(one, layer) for layer in layers]
        wait(futures)
        for fut in futures:
            fut.result()  # the first failure, if any

    def _read_staged(self, fd: int, meta: Meta, skip: int, targets: list[int]) -> None:
        """Device cache: read into host staging, then copy into the blocks. Two buffers,
        so layer i+1 is read (and checksummed) while layer i is copied."""
        mover = self.mover
        p = meta.payload
        flats = [self.staging.get(meta.offsets.layer_bytes) for _ in range(2)]
        pending = None
        try:
            pending = self._readers.submit(read_layer_into, fd, meta, 0, memoryview(flats[0]))
            for layer in range(p.layout.num_layers):
                pending.result()
                if layer + 1 < p.layout.num_layers:
                    nxt = memoryview(flats[(layer + 1) % 2])
                    pending = self._readers.submit(read_layer_into, fd, meta, layer + 1, nxt)
                pages = flats[layer % 2].reshape(p.num_blocks, mover.page_bytes)
                mover.scatter(layer, targets, pages[skip:])
        finally:
            if pending is not None:
                wait([pending])  # never recycle a buffer a read is still filling
            for flat in flats:
                self.staging.put(flat)

    # -- step timing (for the cost-aware load policy) ---------------------------------
    def step_started(self, meta: StepMeta) -> None:
        self._step = (meta.step_tokens, time.perf_counter())

    def step_computed(self) -> None:
        tokens, started = self._step
        if tokens:
            with self._lock:
                self._report.steps.append((tokens, time.perf_counter() - started))
        self._step = (0, 0.0)

    # -- saves ------------------------------------------------------------------------
    def copy_out_and_save(self, meta: StepMeta) -> None:
        mover = self.mover
        for job in meta.saves:
            pages: list[np.ndarray] | None = None
            try:
                if mover is None:
                    raise RuntimeError("KV caches not registered")
                nbytes = len(job.block_ids) * mover.page_bytes
                pages = [self.staging.get(nbytes) for _ in range(mover.layout.num_layers)]
                mover.gather(job.block_ids, pages)
            except Exception as exc:  # noqa: BLE001
                log.warning("kvdisk: copy-out for %s failed: %s", job.sha1, exc)
                self._save_failed(job, str(exc))
                for buf in pages or ():
                    self.staging.put(buf)
                pages = None
            if job.release_blocks:
                self._held.add(job.req_id)
            if pages is not None:
                parent = self._inflight.get(job.parent) if job.parent else None
                self._inflight[job.sha1] = self.pool.submit(self._save, job, pages, parent)

    def _save_failed(self, job: SaveJob, why: str) -> None:
        self.stats.add("save_failures")
        ns = self._fp(job.scope).dirname()
        with self._lock:
            self._report.failed_saves.append((ns, job.sha1))
        self.trace.line(f"save failed reason={job.reason.name.lower()} sha1={job.sha1}: {why}")

    def _save(self, job: SaveJob, pages: list[np.ndarray], parent: Future | None) -> bool:
        try:
            if parent is not None and not parent.result():
                self._save_failed(job, "its parent was not written")
                return False
            t0 = time.perf_counter()
            fp = self._fp(job.scope)
            ns = self.store.ensure_namespace(fp)
            mover = self.mover
            bs = self.block_size
            digest = token_digest(np.frombuffer(job.token_ids, dtype="<u4"))
            payload = Payload(fp.digest(), job.parent, job.parent_tokens, job.parent_tokens // bs,
                              len(job.block_ids), mover.layout, digest)
            encoded = encode_checkpoint(
                text=job.text, tokens=job.token_ids, layers=[memoryview(p).cast("B") for p in pages],
                payload=payload, reason=job.reason, kv_dtype=mover.layout.dtype,
                context_size=job.context_size, now=int(time.time()), tool_map=job.tool_map)
            entry = self.store.write(ns, job.sha1, encoded)
        except Exception as exc:  # noqa: BLE001 - a failed save only costs a future miss
            log.warning("kvdisk: save of %s failed: %s", job.sha1, exc)
            self._save_failed(job, str(exc))
            return False
        finally:
            self._inflight.pop(job.sha1, None)
            for buf in pages:
                self.staging.put(buf)
        with self._lock:
            self._report.written.append(entry)
        seconds = time.perf_counter() - t0
        self.stats.observe("save_seconds", seconds)
        self.stats.count("saves", job.reason.name.lower())
        self.stats.add("bytes_written", entry.size)
        ms = seconds * 1000
        self.trace.line(f"saved reason={job.reason.name.lower()} sha1={job.sha1} "
                        f"tokens={job.tokens} bytes={entry.size} ms={ms:.0f}")
        return True

    # -- step results -----------------------------------------------------------------
    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finished_seen |= finished_req_ids
        sending = self._held & self._finished_seen
        self._held -= sending
        self._finished_seen -= sending
        recving = set()
        for req_id, (fut, job) in list(self._loads.items()):
            if fut.done():
                del self._loads[req_id]
                recving.add(req_id)
                try:
                    bad = fut.result()
                except Exception as exc:  # noqa: BLE001 - recompute everything it covered
                    log.warning("kvdisk: load for %s crashed: %s", req_id, exc)
                    bad = job.block_ids
                if bad:
                    self._load_errors.update(bad)
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_report(self) -> WorkerReport | None:
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return report if report else None

    def stats_snapshot(self) -> KVDiskStats | None:
        self.stats.set("pending_writes", len(self._inflight))
        return self.stats.snapshot()

    def shutdown(self) -> None:
        """Flush: every save already handed to the pool is written before we return."""
        self.pool.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.trace.close()
