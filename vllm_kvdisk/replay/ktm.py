"""The tool maps in checkpoint files: the ``KTM`` section (the seed's map, tool-call id ->
exact text) that the connector writes into a ``.kv`` file whose text contains the call.

Not the tool-call log (:mod:`vllm_kvdisk.replay.log`, ``.ktl`` files): a KTM section holds
no token ids (they are recovered from the file's stored ids, and so is the prompt before
the call: the prefix the record is bound to) and exists only once a checkpoint past the
call was written. Each pair belongs to the namespace of its file: ``poll`` reads only the
namespaces its ``scope`` callback names a tenant for (this model's), and hands each pair
with that tenant, so a pair is only ever looked up by requests of its own namespace.
Read-only; unreadable files are skipped.
The codec is :func:`vllm_kvdisk.core.toolmap.encode_tool_map` / ``decode_tool_map``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_kvdisk.core.format import FormatError
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.replay.memory import prefix_digest
from vllm_kvdisk.storage.fileread import read_tokens, read_tool_map
from vllm_kvdisk.storage.store import Store

log = get_logger(__name__)


class DiskToolMaps:
    """Reads the KTM sections of a cache directory, read-only, each file once."""

    def __init__(self, root: str):
        self.store = Store(root, space_bytes=1, readonly=True)
        self._seen: set[tuple[str, str]] = set()
        self._scopes: dict[str, str | None] = {}  # namespace -> its tenant (None: not ours)
        self._lock = threading.Lock()

    def poll(
        self, scope: Callable[[dict[str, Any]], str | None] = lambda info: ""
    ) -> list[tuple[str, str, str, str, str]]:
        """(tool id, text, namespace, sha1, tenant) from files not read before, least
        recently used file first, in the namespaces whose ``namespace.json`` ``scope``
        maps to a tenant (None: not this model's, not read). Unreadable files are
        skipped."""
        with self._lock:
            tenants: dict[str, str] = {}
            for ns in self.store.namespaces():
                if ns not in self._scopes:  # a name is the digest of what it describes
                    info = self.store.namespace_info(ns)
                    if info is None:
                        continue  # not described (yet): looked at again next time
                    self._scopes[ns] = scope(info)
                tenant = self._scopes[ns]
                if tenant is not None:
                    tenants[ns] = tenant
                    self.store.refresh(ns)
            fresh = [
                e
                for e in list(self.store.index.entries())
                if (e.ns, e.sha1) not in self._seen and e.ns in tenants
            ]
            fresh.sort(key=lambda e: (e.last_used, e.created, e.sha1))
            self._seen &= set(self.store.index.keys())  # bounded by the files there are
            out = []
            for entry in fresh:
                self._seen.add((entry.ns, entry.sha1))
                try:
                    with self.store.open(entry.ns, entry.sha1) as (fd, meta, _):
                        pairs = read_tool_map(fd, meta)
                except (FormatError, OSError, ValueError) as exc:
                    log.debug("kvdisk replay: skipping %s/%s: %s", entry.ns, entry.sha1, exc)
                    continue
                tenant = tenants[entry.ns]
                out += [(tid, text, entry.ns, entry.sha1, tenant) for tid, text in pairs]
            return out

    def recover_tokens(
        self, ns: str, sha1: str, text: str, table: TokenTable
    ) -> tuple[bytes, tuple[int, ...]] | None:
        """The prefix digest of the ids before ``text`` in the file, and the token ids the
        file holds for ``text``: the first occurrence that starts and ends on token
        boundaries (the ids the earlier request sent, sampled ones included)."""
        try:
            with self.store.open(ns, sha1) as (fd, meta, _):
                ids = np.frombuffer(read_tokens(fd, meta), dtype="<u4").astype(np.int64)
            rendered, ends = table.render(ids)
        except (FormatError, OSError, ValueError) as exc:
            log.debug("kvdisk replay: no tokens from %s/%s: %s", ns, sha1, exc)
            return None
        needle = text.encode()
        starts = np.concatenate(([0], ends[:-1])) if len(ends) else ends
        at = rendered.find(needle)
        while needle and at >= 0:
            i = int(np.searchsorted(starts, at))
            j = int(np.searchsorted(ends, at + len(needle)))
            if (
                i < len(starts)
                and starts[i] == at
                and j < len(ends)
                and ends[j] == at + len(needle)
            ):
                return prefix_digest(ids[:i]), tuple(int(t) for t in ids[i : j + 1])
            at = rendered.find(needle, at + 1)
        return None


def load_tool_maps(kv_disk_dir: str) -> list[tuple[str, str]]:
    """Every (tool-call id, exact text) pair in the KTM sections under ``kv_disk_dir``,
    least recently used file first, one pair per id (the most recent file's). Read-only;
    unreadable files are skipped."""
    latest: dict[str, str] = {}
    for tid, text, *_ in DiskToolMaps(kv_disk_dir).poll():
        latest.pop(tid, None)
        latest[tid] = text
    return list(latest.items())
