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

from vllm_kvdisk.core.index import Lookup, Miss
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.ops.trace import Trace
from vllm_kvdisk.storage.fileread import read_text, read_tokens
from vllm_kvdisk.storage.store import Store

log = get_logger(__name__)

QUEUE_SIZE = 256


def explain(
    store: Store, table: TokenTable, ns: str, lookup: Lookup, ids: np.ndarray
) -> tuple[Miss, str]:
    """The refined reason and its words for ``lookup`` of the prompt ``ids``."""
    miss = lookup.miss or Miss.NO_CHECKPOINT
    if miss is Miss.OTHER_NAMESPACE:
        return miss, f"{miss.value} ({', '.join(lookup.other_namespaces)})"
    if miss is not Miss.PREFIX_MISMATCH or not lookup.diverged:
        return miss, miss.value
    text: bytes | None = None
    best: tuple[int, Miss, str] | None = None
    for entry in lookup.diverged[:8]:
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
        if common >= min(len(theirs_text), len(text)):
            found = (
                common,
                Miss.TOKENS_DIFFER,
                f"{Miss.TOKENS_DIFFER.value} at token {at_token} of checkpoint {entry.sha1}",
            )
        else:
            found = (
                common,
                Miss.PREFIX_MISMATCH,
                f"{Miss.PREFIX_MISMATCH.value} at byte {common} (token {at_token}) of "
                f"checkpoint {entry.sha1}",
            )
        if best is None or found[0] > best[0]:
            best = found
    if best is None:
        return miss, miss.value
    return best[1], best[2]


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
    part that reads files (a divergence in words) runs on ``diagnostics``' thread."""

    def __init__(
        self, store: Store, table: TokenTable, stats: Any, trace: Trace, diagnostics: Diagnostics
    ):
        self.store, self.table, self.stats = store, table, stats
        self.trace, self.diagnostics = trace, diagnostics

    def hit(
        self,
        ns: str,
        lookup: Lookup,
        ids: np.ndarray,
        local: int,
        loaded: int,
        files: int,
        source: str = "",
    ) -> None:
        """``source``: ``object`` when files of the chain were fetched from the object
        store for this request (the hit's reason label, and the trace line says so)."""
        self.stats.count("lookups", f"hit:{source}")
        if not self.trace.enabled:
            return
        last, words = lookup.segments[-1].entry.sha1, describe_hit(lookup, local)
        if source:
            words += f"; source={source}"

        def trace_hit() -> None:
            detail = words
            if lookup.miss is not None:
                _, why = explain(self.store, self.table, ns, lookup, ids)
                detail += f"; not deeper: {why}"
            self.trace.hit(last, loaded, files, detail)

        self.diagnostics.submit(trace_hit)

    def no_load(
        self, ns: str, lookup: Lookup, ids: np.ndarray | None, on_device: int, declined: Any
    ) -> None:
        """A lookup that loads nothing: the GPU held it all, or a miss (and why)."""
        if lookup.segments and lookup.tokens <= on_device:
            self.stats.count("lookups", "device_hit:")
            self.trace.device_hit(lookup.segments[-1].entry.sha1, on_device, lookup.tokens)
            return
        miss = lookup.miss or Miss.NO_CHECKPOINT
        if miss is not Miss.PREFIX_MISMATCH or ids is None:
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
                self.trace.miss(None, detail)
            return

        def explain_miss() -> None:  # reads files: off the engine step
            refined, detail = explain(self.store, self.table, ns, lookup, ids)
            self.stats.count("lookups", f"miss:{refined.label}")
            if lookup.segments:
                detail += f"; deepest checkpoint {lookup.tokens} tokens"
            self.trace.miss(lookup.diverged[0].sha1 if lookup.diverged else None, detail)

        if not self.diagnostics.submit(explain_miss):
            self.stats.count("lookups", f"miss:{miss.label}")
