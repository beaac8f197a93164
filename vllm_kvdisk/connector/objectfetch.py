"""The scheduler's fetches from the object store: at most one per request, started when
the bucket holds a deeper prefix of its prompt than the disk, waited on (the request
answers vLLM ``None``) until it ends or its deadline passes (``storage/objecttier``).

A step that computes nothing while requests wait on fetches waits a little for the first
of them to end (``idle``): the engine's loop would otherwise spin on the GIL the fetch's
threads need after each socket read (an in-process engine's loop never sleeps), and the
fetch ran at a fraction of the store's speed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm_kvdisk.core.index import Index
from vllm_kvdisk.core.objects import prefix_names
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.ops.trace import Trace
from vllm_kvdisk.storage.objecttier import Fetch, ObjectTier

IDLE_WAIT_S = 0.01  # longest an idle step waits for a fetch (a new request waits as long)


class ObjectFetches:
    def __init__(
        self,
        tier: ObjectTier,
        index: Index,
        table: TokenTable,
        block_size: int,
        min_tokens: int,
        trace: Trace,
    ):
        self.tier = tier
        self.index = index
        self.table = table
        self.block_size = block_size
        self.min_tokens = min_tokens
        self.trace = trace
        self._waiting: dict[str, Fetch] = {}  # requests waiting on their fetch
        self._had: dict[str, Fetch | None] = {}  # requests that had theirs (one each)

    def start(
        self,
        req_id: str,
        ns: str,
        ids: Any,
        usable: int,
        local_hit: int,
        make_namespaces: Callable[[], list[str]],
    ) -> bool:
        """Fetch what the bucket holds of this prompt deeper than the disk's ``local_hit``
        (once per request, on the tier's threads); True if the request waits for it.
        ``make_namespaces()`` makes ``ns`` and returns the other KV shards' namespaces
        (TP > 1), whose files of the same names are fetched with ``ns``'s."""
        if req_id in self._had or local_hit >= usable - usable % self.block_size:
            return False  # had its fetch, or nothing deeper could exist anywhere
        table, block, first = self.table, self.block_size, self.min_tokens
        index = self.index
        job = self.tier.fetch(
            ns,
            lambda: prefix_names(table, ids, block, usable, first=first),
            local_hit,
            lambda s: index.get(ns, s) is not None,
            make_namespaces,  # their namespace.json, as a save would write it
        )
        self._had[req_id] = job
        if job is None:
            return False
        self._waiting[req_id] = job
        return True

    def waiting(self, req_id: str) -> bool:
        """Whether the request still waits on its fetch: not once it ended or its deadline
        passed (it goes on without; its lookup is then made again)."""
        job = self._waiting.get(req_id)
        if job is None:
            return False
        now = time.monotonic()
        if not job.settled(now):
            return True
        del self._waiting[req_id]
        self.trace.object_fetch(len(job.installed), job.nbytes, now - job.started, job.reason)
        return False

    def idle(self, scheduled_tokens: int) -> bool:
        """A step scheduled ``scheduled_tokens``: if none, and a request waits on a fetch,
        wait (the GIL released) until the soonest fetch ends, ``IDLE_WAIT_S`` at most.
        True if it waited."""
        if scheduled_tokens or not self._waiting:
            return False
        job = min(self._waiting.values(), key=lambda j: j.deadline)
        job.done.wait(max(0.0, min(IDLE_WAIT_S, job.deadline - time.monotonic())))
        return True

    def source(self, req_id: str, files: Iterable[str]) -> str:
        """``object`` if the request's fetch installed any of ``files``, else ``""``."""
        job = self._had.get(req_id)
        return "object" if job is not None and not set(job.installed).isdisjoint(files) else ""

    def finished(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)
        self._had.pop(req_id, None)
