"""KV cache events for what lands on and leaves the disk, in vLLM's own event types.

Cache-aware routers (llm-d, Dynamo) consume vLLM's KV events (``--kv-events-config``) to
know which engine holds which prefix. vLLM publishes its GPU prefix cache's blocks with
``medium="GPU"``; the disk tier adds ``BlockStored`` / ``BlockRemoved`` with
``medium="STORAGE"`` and the *engine's own block hashes* (``request.block_hashes``, the
ones vLLM publishes for the same tokens), so a router can tell a disk-resident prefix
from a cold one.

* A save is announced when its file has landed (the worker's report), never before.
* A file evicted, quarantined, removed by ``reset_cache`` or found replaced is announced
  removed, if this process knows its block hashes (it saved it since it started). Files
  from before a restart or written by other replicas are not announced: vLLM's hashes of
  their blocks are not on disk (salted and LoRA namespaces could not recompute them).

Events are collected only when the engine publishes KV events.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from vllm_kvdisk.core.entry import Key

MEDIUM = "STORAGE"  # vllm.distributed.kv_events.MEDIUM_STORAGE: vLLM's disk-tier medium
MAX_KNOWN_FILES = 200_000


class DiskEvents:
    def __init__(self, enabled: bool, block_size: int):
        self.enabled = enabled
        self.block_size = block_size
        self._planned: dict[Key, tuple[list[Any], Any, list[int], str | None]] = {}
        self._known: OrderedDict[Key, list[Any]] = OrderedDict()
        self._out: list[Any] = []

    def planned(self, key: Key, request: Any, start: int, end: int, lora: str) -> None:
        """A save of the request's tokens [start, end) was planned."""
        if not self.enabled:
            return
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        hashes = list(getattr(request, "block_hashes", None) or [])
        bs = self.block_size
        first, last = start // bs, end // bs
        if len(hashes) < last:
            return  # vLLM has not hashed these blocks (no prefix caching): nothing to say
        parent = maybe_convert_block_hash(hashes[first - 1]) if first else None
        owned = [maybe_convert_block_hash(h) for h in hashes[first:last]]
        self._planned[key] = (owned, parent, list(request.all_token_ids[start:end]), lora or None)

    def landed(self, key: Key) -> None:
        planned = self._planned.pop(key, None)
        if planned is None:
            return
        from vllm.distributed.kv_events import BlockStored

        owned, parent, token_ids, lora = planned
        self._out.append(
            BlockStored(
                block_hashes=owned,
                parent_block_hash=parent,
                token_ids=token_ids,
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=lora,
            )
        )
        self._known[key] = owned
        self._known.move_to_end(key)
        while len(self._known) > MAX_KNOWN_FILES:
            self._known.popitem(last=False)

    def dropped(self, key: Key) -> None:
        self._planned.pop(key, None)

    def removed(self, key: Key) -> None:
        owned = self._known.pop(key, None)
        if owned is None:
            return
        from vllm.distributed.kv_events import BlockRemoved

        self._out.append(BlockRemoved(block_hashes=owned, medium=MEDIUM))

    def removed_namespace(self, ns: str) -> None:
        for key in [k for k in self._known if k[0] == ns]:
            self.removed(key)

    def take(self) -> list[Any]:
        out, self._out = self._out, []
        return out
