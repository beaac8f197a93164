"""The object tier: a bucket behind the local directory, so replicas without a shared
volume share checkpoints (which objects: ``core.objects``; the client: ``objectstore``).

* Uploads are write-behind: a saved file's name goes into a bounded queue that one thread
  drains, reading the file through one descriptor (an eviction meanwhile changes nothing
  it sends) and writing the object only if it is not there (``If-None-Match``). A full
  queue drops the upload (counted ``upload_dropped``); a failed one is tried again after
  each of ``RETRY_AFTER_S`` (``upload_retried``), then counted ``upload_failed``; nothing
  on the engine's step waits for the bucket.
* A replica knows a namespace's objects from a listing (the first lookup in the
  namespace waits for it, within the deadline), its own uploads, and listings again every
  ``LIST_EVERY_S`` or, after a lookup the bucket did not serve, every
  ``LIST_ON_MISS_EVERY_S`` (in the background): never a listing per lookup.
* A fetch downloads, in parallel, the objects of a prompt's prefixes that the local disk
  lacks (and any parent a file names that is elsewhere), each into a temp file in its
  namespace, checks it whole like ``kvdisk verify`` (name = SHA1 of its text, namespace,
  checksums of ids, pages and tool map), and adopts the files parents first like a save
  (under the lock, parent on disk, budget kept, never over an existing name). The normal
  lookup and load then serve them from the local disk. A fetch ends by its deadline
  for the request that waits on it (a slow store: the request recomputes); an object
  proven corrupt is quarantined locally, never fetched again by this process, and deleted
  from the bucket (a name is its content: no sound object of that name can be lost).
* Nothing is deleted from the bucket otherwise: its size is kept by the store's own
  lifecycle rules (docs/DESIGN.md says why).

Pure of vLLM and torch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm_kvdisk.core.config import KVDiskConfig
from vllm_kvdisk.core.format import FormatError, Summary, UnsupportedFile
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.core.objects import Listing, ObjectUrl, to_fetch
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.fileread import check_whole
from vllm_kvdisk.storage.objectstore import Bucket, ObjectStoreError
from vllm_kvdisk.storage.store import Store

log = get_logger(__name__)

UPLOAD_QUEUE = 256  # saved files waiting for their upload; past it an upload is dropped
# A failed upload is tried again after each of these waits, then counted as failed: a store
# that restarts or throttles for minutes still gets the files (a down store costs one
# attempt per file per wait, on the uploader's one thread, never the engine's step).
RETRY_AFTER_S = (5.0, 30.0, 120.0)
RETRY_PENDING_MAX = 4096  # uploads waiting for a retry; past it a failure is final
FETCH_FILES = 8  # objects of one fetch downloaded at once (each in parallel ranges)
PARENT_ROUNDS = 8  # parents named by downloaded files, fetched in at most this many rounds
CALL_TIMEOUT_S = 10.0  # connect and read timeouts of one call to the store


@dataclass(slots=True)
class Fetch:
    """One request's fetch: what it installed, and why it stopped short (``reason``)."""

    ns: str
    deadline: float
    started: float = 0.0
    siblings: tuple[str, ...] = ()  # the other KV shards' namespaces (TP > 1)
    done: threading.Event = field(default_factory=threading.Event)
    installed: list[str] = field(default_factory=list)
    nbytes: int = 0
    reason: str = ""

    def settled(self, now: float) -> bool:
        if self.done.is_set():
            return True
        if now >= self.deadline and not self.reason:
            self.reason = "deadline: the object store did not answer in time"
        return now >= self.deadline


class ObjectTier:
    def __init__(
        self,
        store: Store,
        bucket: Bucket,
        *,
        deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
        queue_max: int = UPLOAD_QUEUE,
        retry_after_s: tuple[float, ...] = RETRY_AFTER_S,
    ):
        self.store = store
        self.bucket = bucket
        self.deadline_s = deadline_s
        self.clock = clock
        self.counts: Counter[str] = Counter()  # outcome -> files (read by the metrics)
        self._lock = threading.Lock()
        self._listings: dict[str, Listing] = {}
        self._bad: set[tuple[str, str]] = set()
        self._uploads: queue.Queue[tuple[str, str, int] | None] = queue.Queue(queue_max)
        self.retry_after_s = retry_after_s
        self._retries: dict[tuple[str, str], tuple[int, float]] = {}  # -> (attempt, due)
        self._jobs = ThreadPoolExecutor(2, thread_name_prefix="kvdisk-fetch")
        self._files = ThreadPoolExecutor(FETCH_FILES, thread_name_prefix="kvdisk-fetch-file")
        self._syncs = ThreadPoolExecutor(FETCH_FILES, thread_name_prefix="kvdisk-fetch-sync")
        self._uploader = threading.Thread(
            target=self._upload_loop, name="kvdisk-upload", daemon=True
        )
        self._uploader.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop, after the uploads queued so far or ``timeout_s``."""
        self.drain(timeout_s)
        with contextlib.suppress(queue.Full):
            self._uploads.put_nowait(None)
        self._uploader.join(timeout_s)
        self._jobs.shutdown(wait=False, cancel_futures=True)
        self._files.shutdown(wait=False, cancel_futures=True)
        self._syncs.shutdown(wait=False, cancel_futures=True)
        self.bucket.close()

    def _count(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.counts[outcome] += n

    def report_to(self, stats: Any) -> None:
        """Move the counts since the last report into a stats recorder (``ops.recorder``):
        ``vllm:kvdisk_object_files_total{outcome}`` and the bytes fetched."""
        with self._lock:
            counts, self.counts = self.counts, Counter()
        for outcome, n in counts.items():
            if outcome == "fetched_bytes":
                stats.add("object_bytes_fetched", n)
            else:
                stats.count("objects", outcome, n)

    # -- uploads ------------------------------------------------------------------------
    def saved(self, ns: str, sha1: str) -> None:
        """A checkpoint landed on the local disk: upload it behind the engine's back."""
        try:
            self._uploads.put_nowait((ns, sha1, 0))
        except queue.Full:
            self._count("upload_dropped")

    def drain(self, timeout_s: float) -> bool:
        """Wait until the uploads queued so far are done, retries included (tests,
        shutdown)."""
        end = self.clock() + timeout_s

        def busy() -> bool:
            with self._lock:
                return bool(self._uploads.unfinished_tasks or self._retries)

        while busy() and self.clock() < end:
            time.sleep(0.01)
        return not busy()

    def _upload_loop(self) -> None:
        while True:
            self._queue_due_retries()
            try:
                item = self._uploads.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                if item is None:
                    return
                self._upload(*item)
            except Exception:  # noqa: BLE001 - the thread must live on
                log.exception("kvdisk: upload of %s failed", item)
                self._count("upload_failed")
            finally:
                self._uploads.task_done()

    def _queue_due_retries(self) -> None:
        now = self.clock()
        with self._lock:
            due = [(k, a) for k, (a, at) in self._retries.items() if at <= now]
        for (ns, sha1), attempt in due:
            try:
                self._uploads.put_nowait((ns, sha1, attempt))
            except queue.Full:
                return  # stays pending: tried when the queue has room
            with self._lock:
                del self._retries[(ns, sha1)]

    def _failed(self, ns: str, sha1: str, attempt: int, why: str) -> None:
        """Try the upload again after the next wait, or count it failed."""
        with self._lock:
            retry = attempt < len(self.retry_after_s) and len(self._retries) < RETRY_PENDING_MAX
            if retry:
                due = self.clock() + self.retry_after_s[attempt]
                self._retries[(ns, sha1)] = (attempt + 1, due)
        log.warning(
            "kvdisk: upload of %s/%s.kv failed (attempt %d)%s: %s",
            ns,
            sha1,
            attempt + 1,
            f"; again in {self.retry_after_s[attempt]:.0f} s" if retry else "",
            why,
        )
        self._count("upload_retried" if retry else "upload_failed")

    def _upload(self, ns: str, sha1: str, attempt: int = 0) -> None:
        try:
            fd = self.store.open_file(ns, sha1)
        except OSError:
            self._count("upload_gone")  # evicted before its turn
            return
        try:
            created = self.bucket.put_file(ns, sha1, fd, os.fstat(fd).st_size)
        except ObjectStoreError as exc:
            self._failed(ns, sha1, attempt, str(exc))
            return
        finally:
            fsdir.close_read(fd)
        self._count("uploaded" if created else "upload_exists")
        with self._lock:
            self._listings.setdefault(ns, Listing(set())).names.add(sha1)

    # -- knowing what the bucket holds ---------------------------------------------------
    def _list(self, ns: str) -> None:
        names = self.bucket.list_names(ns)  # raises ObjectStoreError
        with self._lock:
            listing = self._listings.setdefault(ns, Listing(set()))
            listing.names |= names
            listing.listed_at = self.clock()

    def _list_in_background(self, ns: str) -> None:
        def run() -> None:
            try:
                self._list(ns)
            except ObjectStoreError as exc:
                log.warning("kvdisk: listing the object store failed: %s", exc)
                self._count("list_failed")
            finally:
                with self._lock:
                    self._listings[ns].listing = False

        with self._lock:
            listing = self._listings.setdefault(ns, Listing(set()))
            if not listing.due(self.clock(), missed=True):
                return
            listing.listing = True
        self._jobs.submit(run)

    def _remote(self, ns: str) -> set[str] | None:
        with self._lock:
            listing = self._listings.get(ns)
            if listing is None or listing.listed_at is None:
                return None
            return {s for s in listing.names if (ns, s) not in self._bad}

    # -- fetches -------------------------------------------------------------------------
    def fetch(
        self,
        ns: str,
        names: Callable[[], list[tuple[int, str]]],
        local_hit: int,
        is_local: Callable[[str], bool],
        make_namespaces: Callable[[], list[str]] = list,
    ) -> Fetch | None:
        """Start fetching what the bucket holds of the prompt deeper than ``local_hit``
        (``names()``: its prefixes' names, shallowest first, computed only where the
        bucket holds something of ``ns``; on the fetch's thread before the first listing),
        or None if it holds nothing more as far as this replica knows (a listing may then
        start in the background). ``make_namespaces()``, called once a fetch starts, makes
        the directories and returns the other KV shards' namespaces (TP > 1): each gets
        its files of the names fetched for ``ns``, and a name of ``ns`` is installed only
        once every shard has its file (a rank without one would fail its load)."""
        remote = self._remote(ns)
        found = None
        if remote is not None:
            found = names() if remote else []
            if not to_fetch(found, remote, is_local, local_hit):
                self._list_in_background(ns)
                return None
        now = self.clock()
        job = Fetch(ns, now + self.deadline_s, now, siblings=tuple(make_namespaces()))
        self._jobs.submit(
            self._run, job, found if found is not None else names, local_hit, is_local
        )
        return job

    def _run(
        self,
        job: Fetch,
        names: list[tuple[int, str]] | Callable[[], list[tuple[int, str]]],
        local_hit: int,
        is_local: Callable[[str], bool],
    ) -> None:
        ns = job.ns
        try:
            remote = self._remote(ns)
            if remote is None:
                self._list(ns)
                remote = self._remote(ns) or set()
            found = names() if callable(names) else names
            wanted = [sha1 for _, sha1 in to_fetch(found, remote, is_local, local_hit)]
            with contextlib.ExitStack() as stack:
                got: dict[str, tuple[fsdir.TempFile, Summary]] = {}
                for _ in range(PARENT_ROUNDS):
                    if not wanted or self.clock() >= job.deadline:
                        break
                    for sha1, one in zip(wanted, self._download_all(stack, job, ns, wanted)):
                        if one is not None:
                            got[sha1] = one
                    wanted = [
                        p
                        for _, s in got.values()
                        if (p := s.parent_sha1) is not None
                        and p not in got
                        and p in remote
                        and not is_local(p)
                    ]
                for sibling in job.siblings:  # the other shards first, same names
                    names_here = [s for s in got if self.store.index.get(sibling, s) is None]
                    theirs = self._download_all(stack, job, sibling, names_here)
                    self._install(job, sibling, {s: o for s, o in zip(names_here, theirs) if o})
                whole = {
                    sha1: one
                    for sha1, one in got.items()
                    if all(self.store.index.get(s, sha1) is not None for s in job.siblings)
                }
                if len(whole) < len(got) and not job.reason:
                    job.reason = f"{len(got) - len(whole)} file(s) lack another TP rank's file"
                self._install(job, ns, whole)
        except ObjectStoreError as exc:
            job.reason = f"object store: {exc}"
            self._count("fetch_failed")
        except Exception as exc:  # noqa: BLE001 - a fetch is optional; the request is not
            log.exception("kvdisk: fetch from the object store failed")
            job.reason = f"fetch failed: {exc!r}"
            self._count("fetch_failed")
        finally:
            job.done.set()

    def _download_all(
        self, stack: contextlib.ExitStack, job: Fetch, ns: str, wanted: Iterable[str]
    ) -> list[tuple[fsdir.TempFile, Summary] | None]:
        futures = [self._files.submit(self._download, stack, job, ns, s) for s in wanted]
        return [f.result() for f in futures]

    def _download(
        self, stack: contextlib.ExitStack, job: Fetch, ns: str, sha1: str
    ) -> tuple[fsdir.TempFile, Summary] | None:
        tmp: fsdir.TempFile | None = None

        def target(size: int) -> int | None:
            nonlocal tmp
            if size > self.store.space_bytes:
                return None  # could never fit
            with self._lock:
                tmp = stack.enter_context(self.store.incoming(ns, sha1))
            return tmp.fd

        size = self.bucket.get_into(ns, sha1, target)
        if size is None or tmp is None:
            return None  # gone since the listing, or too large
        # Synced while it is checked (the disk writes, the check reads the page cache),
        # beside the other downloads: not one file after another in the adoption's turn.
        synced = self._syncs.submit(os.fsync, tmp.fd)
        fd = os.open(tmp.name, os.O_RDONLY | fsdir.NOFOLLOW, dir_fd=tmp.dir_fd)
        try:
            summary = check_whole(fd, sha1, ns)
        except UnsupportedFile:
            return None  # another version's file: not ours to judge
        except FormatError as exc:
            self._corrupt(ns, sha1, tmp, str(exc))
            job.reason = f"corrupt object {sha1[:12]}: {exc}"
            return None
        finally:
            os.close(fd)
            concurrent.futures.wait([synced])  # the temp file stays open until it ends
        synced.result()  # an error syncing: the fetch fails, nothing installed
        with self._lock:
            job.nbytes += size
        return tmp, summary

    def _corrupt(self, ns: str, sha1: str, tmp: fsdir.TempFile, why: str) -> None:
        self._count("corrupt")
        with self._lock:
            self._bad.add((ns, sha1))
            listing = self._listings.get(ns)
            if listing is not None:
                listing.names.discard(sha1)
        self.store.quarantine_incoming(ns, sha1, tmp, f"from the object store: {why}")
        try:
            self.bucket.delete(ns, sha1)
        except ObjectStoreError as exc:
            log.warning("kvdisk: could not delete corrupt object %s: %s", sha1, exc)

    def _install(self, job: Fetch, ns: str, got: dict[str, tuple[fsdir.TempFile, Summary]]) -> None:
        """Parents first: a name appears only while its parent is on disk. The names
        installed in the job's own namespace are the job's ``installed``."""
        for sha1, (tmp, summary) in sorted(got.items(), key=lambda kv: kv[1][1].header.tokens):
            try:
                self.store.adopt(ns, sha1, tmp, summary)
            except SaveSkipped as exc:
                if exc.reason != "exists":
                    job.reason = f"not installed: {exc}"
                    self._count("fetch_skipped")
                continue
            if ns == job.ns:
                job.installed.append(sha1)
            self._count("fetched")
        if ns == job.ns and job.installed:
            self._count("fetched_bytes", job.nbytes)


def object_tier(config: KVDiskConfig, store: Store) -> ObjectTier | None:
    """The tier ``kv_object_url`` asks for (None without one); its client is made now, so
    a missing boto3 is said at start, not at the first save."""
    if not config.kv_object_url:
        return None
    url = ObjectUrl.parse(config.kv_object_url)
    bucket = Bucket(url, timeout_s=min(float(config.kv_object_deadline_s), CALL_TIMEOUT_S))
    try:
        bucket.client  # noqa: B018 - made now for its error
    except ImportError as exc:
        raise RuntimeError(
            f"kv_object_url needs boto3 (pip install 'vllm-kvdisk[object]'): {exc}"
        ) from None
    log.info("kvdisk: object tier s3://%s/%s", url.bucket, url.prefix)
    return ObjectTier(store, bucket, deadline_s=config.kv_object_deadline_s)
