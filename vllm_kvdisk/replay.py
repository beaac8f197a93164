"""Exact replay of tool calls: the pure core (no vLLM, no torch).

A chat client sends an assistant tool call back as structured data (``name`` and an
``arguments`` JSON string); the chat template re-serialises it in its own spacing and key
order, so the next prompt differs from the tokens the model sampled and every prefix cache,
vLLM's and ours, stops at the tool call. ds4-server keeps a map from the tool-call id to the
exact block the model generated and re-emits that block instead. So do we:

* **memory**: ``ToolMemory``, an LRU map ``tool-call id -> ToolRecord`` bounded at
  ``tool_memory_max_ids`` ids. A record is the assistant turn the model generated: its
  exact text (the token table's bytes of the sampled ids, trailing stop tokens removed),
  the sampled token ids, and the message the client received (content, and each call's
  name and arguments). Every id of one response points to the same record.
* **disk**: the request that replays ids carries ``kv_transfer_params["kvdisk_tool_map"]``
  (``[[id, exact_text], ...]``); the connector writes the pairs whose text its checkpoint
  contains into the file's KTM section, and ``DiskToolMaps`` reads them back at start-up
  (and when an unknown id shows up, for files other processes wrote).
* **replay**: an assistant message is replayed only if every one of its tool-call ids is
  known, all point to one record, and the message equals what the model produced (same
  names, JSON-equal arguments, same content; no reasoning). The message is then rendered
  with a sentinel as its only content and the sentinel is replaced by the sampled token
  ids, so the prompt equals prompt + sampled tokens of the earlier turn token for token.
  Anything else renders as usual: an id sent back with other arguments is never replayed.

Invariants: replay never changes what a client's message says, only how the same message
is tokenized; a record without token ids (loaded from a file whose tokens could not be
matched) falls back to tokenizing its exact text; nothing here raises out of a lookup.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_kvdisk.control import MAP_KEY  # noqa: F401 - the key the connector reads
from vllm_kvdisk.fileread import read_tokens, read_tool_map
from vllm_kvdisk.format import FormatError
from vllm_kvdisk.keys import TokenTable
from vllm_kvdisk.logs import get_logger
from vllm_kvdisk.store import Store

log = get_logger(__name__)



# -- what a message says ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Signature:
    """An assistant message as the client sees it, normalised for comparison."""

    content: str
    calls: tuple[tuple[str, str], ...]  # (name, canonical arguments)
    reasoning: str = ""


def canonical_arguments(arguments: Any) -> str:
    """JSON-equal arguments compare equal (key order and spacing are the template's)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    try:
        return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return str(arguments)


def plain_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and p.get("type") == "text").strip()
    return str(content).strip()


def make_signature(content: Any, calls: Iterable[tuple[str, Any]],
                   reasoning: Any = None) -> Signature:
    return Signature(plain_text(content),
                     tuple((str(name), canonical_arguments(args)) for name, args in calls),
                     plain_text(reasoning))


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def message_tool_ids(message: Any) -> list[str]:
    if _get(message, "role") != "assistant":
        return []
    return [str(_get(tc, "id")) for tc in (_get(message, "tool_calls") or []) if _get(tc, "id")]


def message_signature(message: Any) -> Signature:
    calls = []
    for tc in _get(message, "tool_calls") or []:
        fn = _get(tc, "function") or {}
        calls.append((_get(fn, "name") or "", _get(fn, "arguments")))
    reasoning = _get(message, "reasoning") or _get(message, "reasoning_content")
    return make_signature(_get(message, "content"), calls, reasoning)


# -- the map ------------------------------------------------------------------------------
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


# -- planning -----------------------------------------------------------------------------
@dataclass(slots=True)
class Replay:
    index: int  # position of the assistant message in the request's messages
    ids: list[str]
    record: ToolRecord


@dataclass(slots=True)
class Plan:
    replays: list[Replay] = field(default_factory=list)
    from_memory: int = 0
    from_disk: int = 0
    missing: int = 0
    changed: int = 0
    fallback: str | None = None  # why rendering did not use the plan

    @property
    def seen_ids(self) -> int:
        return self.from_memory + self.from_disk + self.missing + self.changed

    def summary(self) -> str:
        if self.fallback:
            return (f"none (rendered as usual: {self.fallback}); "
                    f"{self.missing} missing, {self.changed} changed")
        return (f"{self.from_memory} from memory, {self.from_disk} from disk, "
                f"{self.missing} missing, {self.changed} changed")

    def tool_map(self) -> list[list[str]]:
        return [[tid, r.record.text] for r in self.replays for tid in r.ids]


def plan_replay(messages: Sequence[Any], memory: ToolMemory,
                sign: Callable[[ToolRecord], Signature | None]) -> Plan:
    """Which assistant messages can be replayed. ``sign`` parses a disk record's text
    into the message the client would have seen (None if it cannot)."""
    plan = Plan()
    for index, message in enumerate(messages):
        ids = message_tool_ids(message)
        if not ids:
            continue
        records = [memory.get(tid) for tid in ids]
        known = [r for r in records if r is not None]
        plan.missing += len(ids) - len(known)
        if len(known) < len(ids):
            plan.changed += len(known)
            continue
        record = known[0]
        same = all(r is record or r.text == record.text for r in known)
        if same and record.signature is None:
            record.signature = sign(record)
        if (not same or record.signature is None or record.signature.reasoning
                or record.signature != message_signature(message)):
            plan.changed += len(ids)
            continue
        if record.origin == "disk":
            plan.from_disk += len(ids)
        else:
            plan.from_memory += len(ids)
        plan.replays.append(Replay(index, ids, record))
    return plan


def sentinel_messages(messages: Sequence[Any], replays: Sequence[Replay]
                      ) -> tuple[list[Any], list[str]]:
    """The messages with each replayed assistant message reduced to a unique sentinel as
    its content (alphanumeric, so no template escapes or trims it)."""
    nonce = uuid.uuid4().hex
    out = list(messages)
    sentinels = []
    for k, replay in enumerate(replays):
        token = f"KVDISKREPLAY{nonce}X{k}Z"
        sentinels.append(token)
        out[replay.index] = {"role": "assistant", "content": token}
    return out, sentinels


def splice(text: str, sentinels: Sequence[str], replays: Sequence[Replay],
           encode: Callable[[str], list[int]]) -> tuple[list[int], str] | None:
    """Token ids and text of the rendered prompt with each sentinel replaced by the
    replayed turn. The text between sentinels is tokenized on its own: the first piece is
    exactly the earlier turn's prompt, which vLLM tokenized on its own too. None if a
    sentinel is missing, repeated or out of order (the template did something else)."""
    ids: list[int] = []
    parts: list[str] = []
    pos = 0
    for token, replay in zip(sentinels, replays):
        at = text.find(token, pos)
        if at < 0 or text.count(token) != 1:
            return None
        piece = text[pos:at]
        ids += encode(piece) if piece else []
        parts += [piece, replay.record.text]
        tokens = replay.record.token_ids
        ids += list(tokens) if tokens is not None else encode(replay.record.text)
        pos = at + len(token)
    tail = text[pos:]
    ids += encode(tail) if tail else []
    parts.append(tail)
    return ids, "".join(parts)


# -- disk ---------------------------------------------------------------------------------
class DiskToolMaps:
    """Reads the KTM sections of a cache directory, read-only, each file once."""

    def __init__(self, root: str):
        self.store = Store(root, space_bytes=1, readonly=True)
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def poll(self) -> list[tuple[str, str, str, str]]:
        """(tool id, text, namespace, sha1) from files not read before, least recently used
        file first. Unreadable files are skipped."""
        with self._lock:
            for ns in self.store.namespaces():
                self.store.refresh(ns)
            fresh = [e for e in list(self.store.index.entries())
                     if (e.ns, e.sha1) not in self._seen]
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
                out += [(tid, text, entry.ns, entry.sha1) for tid, text in pairs]
            return out

    def recover_tokens(self, ns: str, sha1: str, text: str, table: TokenTable
                       ) -> tuple[int, ...] | None:
        """The token ids the file holds for ``text``: an occurrence that starts and ends on
        token boundaries (the ids the earlier request sent, sampled ones included)."""
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
            if (i < len(starts) and starts[i] == at
                    and j < len(ends) and ends[j] == at + len(needle)):
                return tuple(int(t) for t in ids[i:j + 1])
            at = rendered.find(needle, at + 1)
        return None


def load_tool_maps(kv_disk_dir: str) -> list[tuple[str, str]]:
    """Every (tool-call id, exact text) pair in the KTM sections under ``kv_disk_dir``,
    least recently used file first, one pair per id (the most recent file's). Read-only;
    unreadable files are skipped."""
    latest: dict[str, str] = {}
    for tid, text, _, _ in DiskToolMaps(kv_disk_dir).poll():
        latest.pop(tid, None)
        latest[tid] = text
    return list(latest.items())
