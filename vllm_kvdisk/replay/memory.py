"""Tool-call id -> the assistant turn the model sampled, in memory (an LRU).

A :class:`ToolRecord` is the whole generated turn: its exact text (the token table's bytes
of the sampled ids, trailing stop tokens removed), the sampled token ids, and the message
the client received (content, and each call's name and arguments). Every id of one
response points to the same record. :class:`ToolMemory` bounds the map at
``tool_memory_max_ids`` ids. Pure: no vLLM, no torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.replay.messages import Signature


@dataclass(slots=True)
class ToolRecord:
    text: str  # exact text of the generated turn
    token_ids: tuple[int, ...] | None  # the sampled ids; None until recovered (disk)
    signature: Signature | None  # None until parsed (disk)
    origin: str = "memory"  # "memory": seen by this process; "disk": from a KTM section
    source: tuple[str, str] | None = None  # (namespace, sha1) of the file it came from


class ToolMemory:
    """LRU map tool-call id -> record, never more than ``max_ids`` ids. Thread-safe."""

    def __init__(self, max_ids: int):
        if max_ids < 0:
            raise ValueError(f"max_ids must be >= 0, got {max_ids}")
        self.max_ids = max_ids
        self._map: OrderedDict[str, ToolRecord] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, tool_id: str) -> bool:
        return tool_id in self._map

    def put(self, tool_id: str, record: ToolRecord) -> None:
        if self.max_ids == 0:
            return
        with self._lock:
            self._map[tool_id] = record
            self._map.move_to_end(tool_id)
            while len(self._map) > self.max_ids:
                self._map.popitem(last=False)

    def add_if_absent(self, tool_id: str, record: ToolRecord) -> bool:
        """For disk entries: never replace what this process saw itself."""
        with self._lock:
            if tool_id in self._map:
                return False
        self.put(tool_id, record)
        return True

    def get(self, tool_id: str) -> ToolRecord | None:
        with self._lock:
            record = self._map.get(tool_id)
            if record is not None:
                self._map.move_to_end(tool_id)
            return record

    def records(self) -> list[tuple[list[str], ToolRecord]]:
        """Each record with its ids, least recently used first."""
        with self._lock:
            items = list(self._map.items())
        grouped: dict[int, tuple[list[str], ToolRecord]] = {}
        for tid, record in items:
            grouped.setdefault(id(record), ([], record))[0].append(tid)
        return list(grouped.values())


def strip_stop(token_ids: Sequence[int], special_ids: Iterable[int]) -> list[int]:
    """The sampled ids without trailing special tokens (EOS, end of turn): the template
    writes its own end-of-turn marker after the message."""
    special = set(special_ids)
    ids = list(token_ids)
    while ids and ids[-1] in special:
        ids.pop()
    return ids


def exact_text(table: TokenTable, token_ids: Sequence[int]) -> str | None:
    """The checkpoint-text bytes of ``token_ids`` (what the connector searches), or None
    when they are not whole UTF-8 (generation cut inside a character)."""
    if not token_ids:
        return None
    try:
        raw, _ = table.render(np.asarray(token_ids, dtype=np.int64))
        return raw.decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
