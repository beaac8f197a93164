"""Restore one request's chain of checkpoint files into the engine's KV blocks.

A load job names the files of a chain and, for each, the blocks it contributes
``[start, upto)`` (the last file may be used only up to where the prompt leaves it). Every
file is opened and checked before any page is read: its header says what the index said,
its namespace digest and page layout are the engine's, and its stored token ids equal the
prompt's ids up to ``upto`` (exact ids, not a digest: this is what makes a restore give
the tokens the engine's own prefix cache would). Then the pages are read:

* host-resident caches (the CPU backend) are read straight into runs of the target blocks,
  no staging copy, 1 MiB at a time, each piece hashed while it is in the CPU's caches
  (``pageread.read_layers_into``); pages not used (held by the device already, or past
  ``upto``) are read into
  scratch only so the layer's checksum can be verified, one layer at a time so scratch
  goes back to the pool at once (fresh memory is slow to touch). Files in the page cache
  are read by all reader threads at once; cold files as one sequential stream (an
  ``RWF_NOWAIT`` probe tells which; parallel streams were slower than one on a cold disk).
  Compressed files are read by all reader threads (decoding sets the pace), a cold one
  after asking the kernel to read it ahead in file order (``pageread.read_ahead``).
* device caches are read into host staging and copied into the blocks with torch, layer
  i+1 read while layer i is copied.

It returns only when every read has ended: the blocks of a failed file are recomputed, and
no straggler may write into them afterwards.
"""

from __future__ import annotations

import functools
import math
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field

import numpy as np

from vllm_kvdisk.connector.jobs import LoadFile, LoadJob
from vllm_kvdisk.connector.staging import StagingPool
from vllm_kvdisk.connector.transfer import PageMover
from vllm_kvdisk.core.format import FULL_ONLY, FormatError, Group
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage.fileread import Meta, read_meta, read_token_range, read_tokens
from vllm_kvdisk.storage.pageread import (
    pages_cached,
    read_ahead,
    read_layer_parts,
    read_layers_into,
)
from vllm_kvdisk.storage.store import Store

# Files of a chain open at once: each batch is checked whole, then read, then closed, so a
# chain of any length restores completely with a bounded number of descriptors.
BATCH_FILES = 256
# Pages a restore does not use (before or past the prompt's part of a file) are read only
# for their layer's checksum, through at most this much scratch per read.
SCRATCH_BYTES = 16 << 20


class OpenFailed(Exception):
    """A file of the chain failed its checks (``error``), with the inode it had and, when
    it is proven corrupt, its descriptor still open (``fd``, else -1): the quarantine
    must move the file that was read, and an open descriptor keeps its inode from being
    reused by a replacement."""

    def __init__(self, error: Exception, inode: int, fd: int = -1):
        super().__init__(str(error))
        self.error = error
        self.inode = inode
        self.fd = fd


class StaleFile(Exception):
    """The file is sound but not the one the index described (replaced by another process,
    or it holds other token ids): a miss, not a quarantine."""


@dataclass(slots=True)
class Outcome:
    blocks: int = 0  # blocks restored
    bytes_read: int = 0
    used: list[str] = field(default_factory=list)  # sha1 of every file fully restored
    failed: LoadFile | None = None  # the first file that could not be used
    failed_inode: int = 0  # its inode, when it failed while being opened
    error: Exception | None = None
    bad_blocks: list[int] = field(default_factory=list)  # engine block ids to recompute


@dataclass(slots=True)
class _Open:
    file: LoadFile
    fd: int
    meta: Meta
    blocks: int  # request blocks this file advances the restore by
    # Per layer in file order: (pages before the used ones, pages after them, the engine
    # block ids the used ones go to). One KV cache group: the same for every layer.
    layers: list[tuple[int, int, list[int]]]


class Restorer:
    def __init__(
        self,
        store: Store,
        mover: PageMover,
        staging: StagingPool,
        readers: Executor,
        block_size: int,
        groups: tuple[Group, ...] = FULL_ONLY,
    ):
        self.groups = groups  # the engine's KV cache groups (kind, layers, window)
        self.store = store
        self.mover = mover
        self.staging = staging
        self.readers = readers
        self.block_size = block_size

    def load(
        self,
        ns: str,
        fingerprint: bytes,
        job: LoadJob,
        on_corrupt: Callable[[str, str, int], None] | None = None,
    ) -> Outcome:
        """Restore ``job``; ``on_corrupt(sha1, why, inode)`` is called for a file proven
        corrupt while it is still open (so a replacement written meanwhile under the same
        name, even on a reused inode, is never the one quarantined)."""
        out = Outcome()
        expected = np.frombuffer(job.token_ids, dtype="<u4")
        for at in range(0, len(job.files), BATCH_FILES):
            if not self._load_batch(
                ns, fingerprint, job, job.files[at : at + BATCH_FILES], expected, out, on_corrupt
            ):
                break  # this batch failed: its blocks from the failed file on are recomputed
        if out.failed is not None:
            bs = self.block_size
            first_bad = max(out.failed.start // bs, job.start_block)
            out.bad_blocks = job.block_ids[first_bad - job.start_block :]
        return out

    def _load_batch(
        self,
        ns: str,
        fingerprint: bytes,
        job: LoadJob,
        files: list[LoadFile],
        expected: np.ndarray,
        out: Outcome,
        on_corrupt: Callable[[str, str, int], None] | None,
    ) -> bool:
        """Check every file of one batch, then read their pages; False if one failed."""
        opened: list[_Open] = []
        failed_fd = -1
        try:
            for file in files:  # check every file of the batch before reading any page
                try:
                    opened.append(self._open(ns, fingerprint, file, job, expected))
                except OpenFailed as refused:
                    out.failed, out.error, out.failed_inode = file, refused.error, refused.inode
                    failed_fd = refused.fd
                    break
            results = self._read_all(opened)
            bad = next((i for i, r in enumerate(results) if r is not None), None)
            if bad is not None:  # a read failed: it and every later file are recomputed
                out.failed, out.error = opened[bad].file, results[bad]
                opened_ok = opened[:bad]
            else:
                opened_ok = opened
            for o in opened_ok:
                out.blocks += o.blocks
                out.bytes_read += o.meta.offsets.ktm - o.meta.offsets.pages
                out.used.append(o.file.sha1)
            if isinstance(out.error, FormatError) and on_corrupt is not None:
                failed = next((o for o in opened if o.file is out.failed), None)
                if failed is not None:
                    on_corrupt(failed.file.sha1, str(out.error), os.fstat(failed.fd).st_ino)
                elif out.failed is not None:  # failed its checks while opened (failed_fd)
                    on_corrupt(out.failed.sha1, str(out.error), out.failed_inode)
        finally:
            for o in opened:
                fsdir.close_read(o.fd)
            if failed_fd >= 0:
                fsdir.close_read(failed_fd)
        return out.failed is None

    # -- checks -------------------------------------------------------------------------
    def _open(
        self, ns: str, fingerprint: bytes, file: LoadFile, job: LoadJob, expected: np.ndarray
    ) -> _Open:
        try:
            fd = self.store.open_file(ns, file.sha1)
        except Exception as exc:  # noqa: BLE001 - gone, a symlink, an I/O error: a miss
            raise OpenFailed(exc, 0) from exc
        inode = 0
        try:
            st = os.fstat(fd)
            inode = st.st_ino
            # The other TP ranks' files of this checkpoint were never indexed by the
            # scheduler: their stored ids and header are checked below like every file's.
            if file.inode and ns == job.indexed_ns and st.st_ino != file.inode:
                raise StaleFile("replaced by another process since it was indexed")
            meta = read_meta(fd, st.st_size)
            h, p = meta.header, meta.payload
            if (h.tokens, p.parent_tokens) != (file.tokens, file.start):
                raise StaleFile(
                    f"file holds tokens [{p.parent_tokens}, {h.tokens}), "
                    f"index said [{file.start}, {file.tokens})"
                )
            if p.fingerprint != fingerprint:
                raise FormatError("file belongs to another namespace (model/layout/salt)")
            if p.layout != self.mover.layout:  # a sound file of an engine that splits blocks
                # into other kernel blocks (the namespace cannot tell): a miss, not corrupt
                raise StaleFile(f"page layout {p.layout} != engine's {self.mover.layout}")
            stored = np.frombuffer(
                read_token_range(fd, meta.offsets.tokens, 0, file.upto), dtype="<u4"
            )
            if len(expected) < file.upto or not np.array_equal(stored, expected[: file.upto]):
                read_tokens(fd, meta)  # corrupt ids raise FormatError (checksum) here
                raise StaleFile("its token ids are not the prompt's")
            bs = self.block_size
            first_used = max(file.start // bs, job.start_block)
            if not file.ranges:
                targets = job.block_ids[
                    first_used - job.start_block : file.upto // bs - job.start_block
                ]
                if len(targets) != file.upto // bs - first_used:
                    raise ValueError("load job has fewer target blocks than the file")
                layer = (
                    first_used - p.first_block,
                    p.first_block + p.num_blocks - file.upto // bs,
                    targets,
                )
                layers = [layer] * p.layout.num_layers
            else:
                layers = self._group_layers(file, job, p.groups)
            return _Open(file, fd, meta, file.upto // bs - first_used, layers)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, FormatError):  # kept open until it is quarantined
                raise OpenFailed(exc, inode, fd) from exc
            fsdir.close_read(fd)
            raise OpenFailed(exc, inode) from exc

    def _group_layers(
        self, file: LoadFile, job: LoadJob, groups: tuple[Group, ...]
    ) -> list[tuple[int, int, list[int]]]:
        """Per layer of a hybrid model's file: the pages before and after the ones used
        and the engine blocks they go to (each group its own range and block table)."""
        mine = [(g.kind, g.layers, g.window) for g in self.groups]
        if [(g.kind, g.layers, g.window) for g in groups] != mine:
            raise StaleFile(f"KV cache groups {groups} are not the engine's")
        if len(file.ranges) != len(groups) or len(job.groups) != len(groups):
            raise ValueError("load job does not name a block range per KV cache group")
        per_group: list[tuple[int, int, list[int]]] = []
        for g, (a, c), ids in zip(groups, file.ranges, job.groups):
            if c <= a:  # nothing of this group from this file: checksummed only
                per_group.append((g.num_blocks, 0, []))
                continue
            if a < g.first_block or c > g.first_block + g.num_blocks or a < job.start_block:
                raise ValueError(
                    f"blocks {a}..{c} are not in the file's group ({g.first_block}+{g.num_blocks})"
                )
            targets = ids[a - job.start_block : c - job.start_block]
            if len(targets) != c - a:
                raise ValueError("load job has fewer target blocks than the file")
            per_group.append((a - g.first_block, g.first_block + g.num_blocks - c, targets))
        return [per_group[i] for i, g in enumerate(groups) for _ in range(g.layers)]

    # -- reads --------------------------------------------------------------------------
    def _read_all(self, opened: list[_Open]) -> list[Exception | None]:
        """Read every opened file; one result per file (None: restored)."""
        results: list[Exception | None] = [None] * len(opened)
        if not self.mover.host_resident:
            for i, o in enumerate(opened):
                try:
                    self._read_staged(o)
                except Exception as exc:  # noqa: BLE001
                    results[i] = exc
                    break
            return results
        cold: list[tuple[int, Callable[[], None]]] = []
        futures = []
        cached = [pages_cached(o.fd, o.meta) for o in opened]
        warm_bytes = sum(
            o.meta.offsets.ktm - o.meta.offsets.pages for o, c in zip(opened, cached) if c
        )
        threads = getattr(self.readers, "_max_workers", 1)
        for i, o in enumerate(opened):
            if cached[i] or o.meta.payload.packing is not None:
                # In the page cache, or compressed (decoding, not the disk, sets the pace):
                # every reader thread at once.
                # Twice as many tasks as threads, by bytes: with one per thread, five
                # files on four threads left one thread 40% of the work.
                if not cached[i] and all(not f and not b for f, b, _ in o.layers):
                    read_ahead(o.fd, o.meta)  # cold and compressed: stream it in file order
                share = (o.meta.offsets.ktm - o.meta.offsets.pages) / max(1, warm_bytes)
                tasks = self._direct_tasks(o, groups=max(1, math.ceil(2 * threads * share)))
                futures += [(i, self.readers.submit(task)) for task in tasks]
            else:
                cold += [(i, task) for task in self._direct_tasks(o, groups=1)]
        try:
            for i, task in cold:  # one sequential stream, in file order
                if results[i] is None:
                    try:
                        task()
                    except Exception as exc:  # noqa: BLE001
                        results[i] = exc
        finally:
            wait([f for _, f in futures])
        for i, fut in futures:
            raised = fut.exception()
            if raised is not None and results[i] is None:
                results[i] = raised if isinstance(raised, Exception) else RuntimeError(str(raised))
        return results

    def _direct_tasks(self, o: _Open, groups: int) -> list[Callable[[], None]]:
        """Read tasks for one file straight into the host-resident blocks: ``groups``
        tasks of consecutive layers, one preadv each, when every page is used."""
        mover, meta = self.mover, o.meta
        n_layers = meta.payload.layout.num_layers
        runs: dict[int, list[tuple[int, int]]] = {}  # per target list (one per group)
        for _, _, targets in o.layers:
            if id(targets) not in runs:
                runs[id(targets)] = mover.block_runs(targets)
        if all(not front and not back for front, back, _ in o.layers):  # every page used
            groups = min(max(1, groups), n_layers)
            cuts = [n_layers * g // groups for g in range(groups + 1)]

            def read(first: int, stop: int) -> None:
                read_layers_into(
                    o.fd,
                    meta,
                    first,
                    [
                        mover.host_views(layer, runs[id(o.layers[layer][2])])
                        for layer in range(first, stop)
                    ],
                )

            return [functools.partial(read, a, b) for a, b in zip(cuts, cuts[1:]) if b > a]

        pb = mover.page_bytes

        def one(layer: int) -> None:
            front, back, targets = o.layers[layer]
            scratch = self.staging.get(max(pb, min((front + back) * pb, SCRATCH_BYTES)))
            try:
                read_layer_parts(
                    o.fd,
                    meta,
                    layer,
                    [
                        (front * pb, None),
                        (len(targets) * pb, mover.host_views(layer, runs[id(targets)])),
                        (back * pb, None),
                    ],
                    scratch.data,
                )
            finally:
                self.staging.put(scratch)

        return [functools.partial(one, layer) for layer in range(n_layers)]

    def _read_staged(self, o: _Open) -> None:
        """Device cache: read the used pages into host staging (the others only through a
        bounded scratch, for the checksum), then copy them into the blocks. Raw pages: two
        sets of buffers, so layer i+1 is read (and checksummed) while layer i is copied;
        compressed pages: one set per reader thread and one more, so the threads decode
        that many layers side by side while the copies run."""
        mover, meta = self.mover, o.meta
        pb = mover.page_bytes
        n_layers = meta.payload.layout.num_layers
        depth = 2
        if meta.payload.packing is not None:
            depth = getattr(self.readers, "_max_workers", 1) + 1
        depth = max(1, min(depth, n_layers))
        biggest = max(pb, max(len(t) for _, _, t in o.layers) * pb)
        scratch_bytes = max(pb, min(max((f + b) * pb for f, b, _ in o.layers), SCRATCH_BYTES))
        flats = [self.staging.get(biggest) for _ in range(depth)]
        scratches = [self.staging.get(scratch_bytes) for _ in range(depth)]

        def read(layer: int) -> Future:
            front, back, targets = o.layers[layer]
            k, used = layer % depth, len(targets) * pb
            parts = [(front * pb, None), (used, [flats[k].data[:used]]), (back * pb, None)]
            return self.readers.submit(
                read_layer_parts, o.fd, meta, layer, parts, scratches[k].data
            )

        pending: deque[Future] = deque()
        try:
            for layer in range(min(depth - 1, n_layers) or 1):
                pending.append(read(layer))
            for layer in range(n_layers):
                pending.popleft().result()
                ahead = layer + max(1, depth - 1)
                if ahead < n_layers:
                    pending.append(read(ahead))
                targets = o.layers[layer][2]
                if targets:
                    used = len(targets) * pb
                    flat = flats[layer % depth]
                    mover.scatter(layer, targets, flat[:used].reshape(len(targets), pb))
        finally:
            wait(list(pending))  # never recycle a buffer a read is still filling
            for buf in flats + scratches:
                self.staging.put(buf)
