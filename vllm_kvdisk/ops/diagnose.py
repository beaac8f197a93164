"""Why a lookup went no deeper, in words: the part of a miss or hit that reads files,
and the one place that counts a lookup's outcome and writes its trace line.

Lookups decide from the index alone; explaining a divergence ("the prompt leaves
checkpoint X at byte 4190", "same text, different tokens at token 712") needs the
checkpoint's text and ids and the prompt's rendered text. That work runs here, on one
background thread, never in the engine step: it refines the miss reason counted in the
metrics and writes the trace line. A full queue drops the explanation, never blocks.

Pure of vLLM and torch.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.index import Lookup, Miss
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.core.report import CacheReport, Divergence, excerpt
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.ops.trace import Trace
from vllm_kvdisk.storage.fileread import read_text, read_tokens
from vllm_kvdisk.storage.store import Store

log = get_logger(__name__)

QUEUE_SIZE = 256


def diverge(
    store: Store,
    table: TokenTable,
    ns: str,
    entries: list[Entry],
    ids: np.ndarray,
    excerpt_bytes: int = 0,
) -> Divergence | None:
    """Where the prompt ``ids`` leaves the nearest of ``entries`` (files of namespace
    ``ns``, the request's own: no other scope's text is ever read here): the checkpoint
    whose stored text shares the longest prefix with the prompt's rendered text. With
    ``excerpt_bytes``, excerpts of both sides around the divergence."""
    text: bytes | None = None
    best: tuple[int, Divergence] | None = None
    for entry in entries[:8]:
        try:
            with store.open(ns, entry.sha1) as (fd, meta, _):
                theirs_text = read_text(fd, meta)
                theirs_ids = np.frombuffer(read_tokens(fd, meta), dtype="<u4")
        except Exception as exc:  # noqa: BLE001 - diagnostics never fail anything
            log.debug("kvdisk: cannot explain with %s: %s", entry.sha1, exc)
            continue
        if text is None:
            text, _ = table.render(ids)
        common = len(os.path.commonprefix([theirs_text, text[: len(theirs_text)]]))
        n = min(len(ids), len(theirs_ids))
        differ = np.flatnonzero(ids[:n] != theirs_ids[:n])
        at_token = int(differ[0]) if differ.size else n
        same_text = common >= min(len(theirs_text), len(text))
        found = Divergence(
            Miss.TOKENS_DIFFER if same_text else Miss.PREFIX_MISMATCH,
            entry.sha1,
            at_token,
            common,
            excerpt(text, common, excerpt_bytes) if excerpt_bytes > 0 else None,
            excerpt(theirs_text, common, excerpt_bytes) if excerpt_bytes > 0 else None,
        )
        if best is None or common > best[0]:
            best = (common, found)
    return best[1] if best is not None else None


def explain(
    store: Store,
    table: TokenTable,
    ns: str,
    lookup: Lookup,
    ids: np.ndarray,
    excerpt_bytes: int = 0,
) -> tuple[Miss, str, Divergence | None]:
    """The refined reason, its words and where the prompt diverged, for ``lookup`` of
    the prompt ``ids``. A lookup that found no checkpoint starting like the prompt keeps
    its reason (no checkpoint); its words then name the nearest one."""
    miss = lookup.miss or Miss.NO_CHECKPOINT
    if miss is Miss.OTHER_NAMESPACE:
        return miss, f"{miss.value} ({', '.join(lookup.other_namespaces)})", None
    if miss not in (Miss.PREFIX_MISMATCH, Miss.NO_CHECKPOINT) or not lookup.diverged:
        return miss, miss.value, None
    found = diverge(store, table, ns, lookup.diverged, ids, excerpt_bytes)
    if found is None:
        return miss, miss.value, None
    if miss is Miss.NO_CHECKPOINT:
        return miss, f"{miss.value}; nearest: {found.words()}", found
    return found.reason, found.words(), found


class Diagnostics:
    """One daemon thread that runs explanation jobs in order."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(QUEUE_SIZE)
        self._thread = threading.Thread(target=self._run, name="kvdisk-diagnose", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> bool:
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            return False

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001
                log.exception("kvdisk: diagnostics job failed")
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every submitted job ran (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        try:
            self._queue.put(None, timeout=1)
        except queue.Full:
            return
        self._thread.join(timeout=5)


def describe_hit(lookup: Lookup, local: int) -> str:
    """The hit's own words: how much of which file is used, what the GPU already held."""
    parts = [f"{local} already in the GPU cache"]
    last = lookup.segments[-1] if lookup.segments else None
    if last is not None and not last.whole:
        parts.append(f"{last.entry.sha1} used up to token {last.upto} of {last.entry.tokens}")
    return "; ".join(parts)


class LookupReport:
    """Counts each lookup's outcome in ``lookups{outcome}`` and writes its trace line; the
    part that reads files (a divergence in words) runs on ``diagnostics``' thread, and
    fills the request's :class:`CacheReport` ``divergence`` when it is done."""

    def __init__(
        self,
        store: Store,
        table: TokenTable,
        stats: Any,
        trace: Trace,
        diagnostics: Diagnostics,
        excerpt_bytes: int = 0,
    ):
        self.store, self.table, self.stats = store, table, stats
        self.trace, self.diagnostics = trace, diagnostics
        self.excerpt_bytes = excerpt_bytes

    def _explain(
        self, ns: str, lookup: Lookup, ids: np.ndarray, report: CacheReport | None
    ) -> tuple[Miss, str]:
        refined, words, found = explain(self.store, self.table, ns, lookup, ids, self.excerpt_bytes)
        if report is not None and found is not None:
            if report.reason is Miss.PREFIX_MISMATCH:
                report.reason = refined  # as the metric counts it (tokens_differ, say)
            report.divergence = found  # one attribute store: the step thread reads it whole
        return refined, words

    def hit(
        self,
        ns: str,
        lookup: Lookup,
        ids: np.ndarray,
        local: int,
        loaded: int,
        files: int,
        source: str = "",
        report: CacheReport | None = None,
        request: str = "",
    ) -> None:
        """``source``: ``object`` when files of the chain were fetched from the object
        store for this request (the hit's reason label, and the trace line says so)."""
        self.stats.count("lookups", f"hit:{source}")
        explains = lookup.miss is not None and bool(lookup.diverged)
        if not self.trace.enabled and not (explains and report is not None):
            return
        last, words = lookup.segments[-1].entry.sha1, describe_hit(lookup, local)
        if source:
            words += f"; source={source}"

        def trace_hit() -> None:
            detail = words
            if lookup.miss is not None:
                _, why = self._explain(ns, lookup, ids, report)
                detail += f"; not deeper: {why}"
            self.trace.hit(last, loaded, files, detail, request)

        self.diagnostics.submit(trace_hit)

    def no_load(
        self,
        ns: str,
        lookup: Lookup,
        ids: np.ndarray | None,
        on_device: int,
        declined: Any,
        report: CacheReport | None = None,
        request: str = "",
    ) -> None:
        """A lookup that loads nothing: the GPU held it all, or a miss (and why)."""
        if lookup.segments and lookup.tokens <= on_device:
            self.stats.count("lookups", "device_hit:")
            self.trace.device_hit(lookup.segments[-1].entry.sha1, on_device, lookup.tokens, request)
            if report is not None and ids is not None and lookup.diverged:

                def explain_only() -> None:  # the report's divergence; the trace said device hit
                    self._explain(ns, lookup, ids, report)

                self.diagnostics.submit(explain_only)
            return
        miss = lookup.miss or Miss.NO_CHECKPOINT
        if (
            ids is None
            or not lookup.diverged
            or miss
            not in (
                Miss.PREFIX_MISMATCH,
                Miss.NO_CHECKPOINT,
            )
        ):
            self.stats.count("lookups", f"miss:{miss.label}")
            if self.trace.enabled:
                detail = miss.value
                if miss is Miss.OTHER_NAMESPACE:
                    detail += f" ({', '.join(lookup.other_namespaces)})"
                if miss is Miss.CHEAPER_TO_RECOMPUTE and declined is not None:
                    detail += (
                        f": load {declined.load_s * 1e3:.0f} ms vs prefill "
                        f"{declined.recompute_s * 1e3:.0f} ms"
                    )
                if lookup.segments:
                    detail += f"; deepest checkpoint {lookup.tokens} tokens"
                self.trace.miss(None, detail, request)
            return

        def explain_miss() -> None:  # reads files: off the engine step
            refined, detail = self._explain(ns, lookup, ids, report)
            self.stats.count("lookups", f"miss:{refined.label}")
            if lookup.segments:
                detail += f"; deepest checkpoint {lookup.tokens} tokens"
            self.trace.miss(lookup.diverged[0].sha1 if lookup.diverged else None, detail, request)

        if not self.diagnostics.submit(explain_miss):
            self.stats.count("lookups", f"miss:{miss.label}")
