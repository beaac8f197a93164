"""Tool-call id -> the assistant turn the model sampled, in memory (an LRU), per tenant.

A :class:`ToolRecord` is the whole generated turn: its exact text (the token table's bytes
of the sampled ids, trailing stop tokens removed), the sampled token ids, the message the
client received (content, and each call's name and arguments), the **tenant** it belongs
to (a digest of the LoRA adapter and cache salt of the request that sampled it) and the
**prefix** it was sampled after (a digest of that request's prompt token ids). Every id of
one response points to the same record.

Invariants: the tenant is part of the key, so a lookup can only find a record of the
asker's own tenant (an id another tenant also uses is simply unknown); the map holds at
most ``max_ids`` ids and ``max_bytes`` bytes of records (text, token ids, ids), least
recently used first out. Pure: no vLLM, no torch.
"""

from __future__ import annotations

import array
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.replay.messages import Signature

PREFIX_BYTES = 32
RECORD_OVERHEAD = 256  # the record object, its signature, its LRU slot: a fair floor
ID_OVERHEAD = 96  # one id's key tuple and dict slot


def compact_ids(token_ids: Iterable[int]) -> array.array[int]:
    """Token ids as 4 bytes each (a tuple of ints costs ~36 bytes per id)."""
    return array.array("I", token_ids)


PREFIX_SEED = b"kvdisk-replay-prefix\0"


def prefix_digest(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """What binds a record to the prompt it was sampled after: SHA-256 of the prompt's
    token ids (little-endian u32). A collision would need a SHA-256 collision."""
    raw = np.asarray(token_ids, dtype=np.int64).astype("<u4").tobytes()
    return hashlib.sha256(PREFIX_SEED + raw).digest()


def tenant_key(lora: str, salt_digest: str) -> str:
    """The replay scope of a request within one model: its LoRA adapter and the digest of
    its cache salt (never the salt itself)."""
    raw = f"{lora}\0{salt_digest}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"kvdisk-replay-tenant\0" + raw).hexdigest()[:32]


@dataclass(slots=True)
class ToolRecord:
    text: str  # exact text of the generated turn
    token_ids: Sequence[int] | None  # the sampled ids; None until recovered (disk)
    signature: Signature | None  # None until parsed (disk)
    origin: str = "memory"  # "memory": seen by this process; "disk": from a log or a file
    source: tuple[str, str] | None = None  # (namespace, sha1) of the file it came from
    tenant: str = ""  # tenant_key() of the request that sampled it
    prefix: bytes | None = None  # prefix_digest() of its prompt; None until recovered
    # (the ids it was checked with, whether it hides text from them): checked once
    hidden: tuple[tuple[str, ...], bool] | None = None

    def cost(self) -> int:
        """Bytes this record holds in memory, ids not counted. Without token ids yet
        (recovered later from a file), as if each byte of text were a token."""
        text = len(self.text.encode("utf-8", "surrogatepass"))
        ids = 4 * (text if self.token_ids is None else len(self.token_ids))
        return RECORD_OVERHEAD + text + ids


class ToolMemory:
    """LRU map (tenant, tool-call id) -> record, never more than ``max_ids`` ids nor
    ``max_bytes`` bytes. Thread-safe."""

    def __init__(self, max_ids: int, max_bytes: int | None = None):
        if max_ids < 0:
            raise ValueError(f"max_ids must be >= 0, got {max_ids}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_ids = max_ids
        self.max_bytes = max_bytes
        self._map: OrderedDict[tuple[str, str], ToolRecord] = OrderedDict()
        # id(record) -> (how many ids point to it, its cost when it came in)
        self._refs: dict[int, tuple[int, int]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._map)

    @property
    def bytes(self) -> int:
        return self._bytes

    def contains(self, tenant: str, tool_id: str) -> bool:
        return (tenant, tool_id) in self._map

    def _link(self, key: tuple[str, str], record: ToolRecord) -> None:
        n, cost = self._refs.get(id(record), (0, 0))
        if n == 0:
            cost = record.cost()
            self._bytes += cost
        self._refs[id(record)] = (n + 1, cost)
        self._bytes += ID_OVERHEAD + len(key[1])
        self._map[key] = record

    def _unlink(self, key: tuple[str, str]) -> None:
        record = self._map.pop(key)
        n, cost = self._refs[id(record)]
        self._bytes -= ID_OVERHEAD + len(key[1])
        if n > 1:
            self._refs[id(record)] = (n - 1, cost)
        else:
            del self._refs[id(record)]
            self._bytes -= cost

    def put(self, tenant: str, tool_id: str, record: ToolRecord) -> None:
        if self.max_ids == 0 or self.max_bytes == 0:
            return
        key = (tenant, tool_id)
        with self._lock:
            if key in self._map:
                self._unlink(key)
            self._link(key, record)
            while self._map and (
                len(self._map) > self.max_ids
                or (self.max_bytes is not None and self._bytes > self.max_bytes)
            ):
                self._unlink(next(iter(self._map)))

    def add_if_absent(self, tenant: str, tool_id: str, record: ToolRecord) -> bool:
        """For disk entries: never replace what this process saw itself."""
        with self._lock:
            if (tenant, tool_id) in self._map:
                return False
        self.put(tenant, tool_id, record)
        return self.contains(tenant, tool_id)

    def get(self, tenant: str, tool_id: str) -> ToolRecord | None:
        key = (tenant, tool_id)
        with self._lock:
            record = self._map.get(key)
            if record is not None:
                self._map.move_to_end(key)
            return record

    def records(self) -> list[tuple[list[str], ToolRecord]]:
        """Each record with its ids, least recently used first."""
        with self._lock:
            items = list(self._map.items())
        grouped: dict[int, tuple[list[str], ToolRecord]] = {}
        for (_, tid), record in items:
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
