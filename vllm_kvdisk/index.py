"""In-memory index of the checkpoints on disk: entries, chains, lookups, eviction plans.

Invariants:
* An entry is in the index only once its file is complete (two-phase: ``reserve`` makes a
  save visible to *parent selection and duplicate checks* only, never to lookups).
* A file owns the blocks ``[parent_tokens, tokens)``; a chain is the path root -> entry.
  A chain whose parent is missing or does not end where its child starts is broken and is
  never returned as a hit.
* Eviction removes leaves only, so a parent never goes before its children.

Pure: no I/O. It returns decisions; ``store.Store`` executes them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Sequence

from vllm_kvdisk.format import Reason
from vllm_kvdisk.keys import PrefixKey

HALF_LIFE_S = 6 * 3600

Key = tuple[str, str]  # (namespace, sha1)


@dataclass(slots=True)
class Entry:
    ns: str
    sha1: str
    tokens: int
    parent: str | None
    parent_tokens: int
    reason: Reason
    hits: int
    created: int
    last_used: int
    size: int
    token_digest: int

    @property
    def key(self) -> Key:
        return (self.ns, self.sha1)


class Miss(str, Enum):
    """Why a lookup found nothing deeper; ``label`` is the metric label value."""

    NO_CHECKPOINT = "no checkpoint"
    BELOW_MIN_TOKENS = "below min tokens"
    PREFIX_MISMATCH = "prefix mismatch"
    TOKENS_DIFFER = "text equal but tokens differ"
    BROKEN_CHAIN = "broken chain"
    OTHER_NAMESPACE = "checkpoint of another model/layout/dtype/salt"
    CHEAPER_TO_RECOMPUTE = "cheaper to recompute"

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class Lookup:
    """The deepest usable chain for a prompt, or why there is none deeper."""

    chain: list[Entry] = field(default_factory=list)
    # Why the next deeper grid position did not hit, and the key it was checked under.
    miss: Miss | None = None
    miss_key: PrefixKey | None = None
    other_namespaces: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        return self.chain[-1].tokens if self.chain else 0


def score(entry: Entry, now: float) -> float:
    """ds4's keep-worthiness: (decayed hits + 1) x tokens / bytes. Lower goes first."""
    age = max(0.0, now - entry.last_used)
    decayed = entry.hits * 0.5 ** (age / HALF_LIFE_S)
    return (decayed + 1.0) * entry.tokens / max(1, entry.size)


class Index:
    def __init__(self) -> None:
        self._entries: dict[Key, Entry] = {}
        self._children: dict[Key, set[str]] = {}
        self._by_sha1: dict[str, set[str]] = {}  # sha1 -> namespaces holding it
        self._pending: dict[Key, Entry] = {}
        self.total_bytes = 0

    def clear(self) -> None:
        """Forget everything (the same object stays shared with planners)."""
        for table in (self._entries, self._children, self._by_sha1, self._pending):
            table.clear()
        self.total_bytes = 0

    # -- membership -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def get(self, ns: str, sha1: str) -> Entry | None:
        return self._entries.get((ns, sha1))

    def entries(self) -> Iterable[Entry]:
        return self._entries.values()

    def add(self, entry: Entry) -> None:
        old = self._entries.get(entry.key)
        if old is not None:
            self.remove(old.ns, old.sha1)
        self._entries[entry.key] = entry
        self.total_bytes += entry.size
        self._by_sha1.setdefault(entry.sha1, set()).add(entry.ns)
        if entry.parent:
            self._children.setdefault((entry.ns, entry.parent), set()).add(entry.sha1)
        self._pending.pop(entry.key, None)

    def remove(self, ns: str, sha1: str) -> Entry | None:
        entry = self._entries.pop((ns, sha1), None)
        if entry is None:
            return None
        self.total_bytes -= entry.size
        spaces = self._by_sha1.get(sha1)
        if spaces is not None:
            spaces.discard(ns)
            if not spaces:
                del self._by_sha1[sha1]
        if entry.parent:
            kids = self._children.get((ns, entry.parent))
            if kids is not None:
                kids.discard(sha1)
                if not kids:
                    del self._children[(ns, entry.parent)]
        return entry

    def children(self, ns: str, sha1: str) -> list[Entry]:
        names = self._children.get((ns, sha1), ())
        return [self._entries[(ns, s)] for s in names if (ns, s) in self._entries]

    # -- two-phase saves --------------------------------------------------------------
    def reserve(self, entry: Entry) -> bool:
        """Mark a save in flight. False if the key is already on disk or in flight."""
        if entry.key in self._entries or entry.key in self._pending:
            return False
        self._pending[entry.key] = entry
        return True

    def release(self, ns: str, sha1: str) -> None:
        """The save in flight failed or was abandoned."""
        self._pending.pop((ns, sha1), None)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def pending(self, ns: str, sha1: str) -> Entry | None:
        return self._pending.get((ns, sha1))

    # -- chains and lookups -----------------------------------------------------------
    def chain(self, ns: str, sha1: str, *, include_pending: bool = False) -> list[Entry] | None:
        """Entries root -> sha1, or None if a link is missing or inconsistent."""
        out: list[Entry] = []
        key: str | None = sha1
        expect_end: int | None = None
        while key is not None:
            entry = self._entries.get((ns, key))
            if entry is None and include_pending:
                entry = self._pending.get((ns, key))
            if entry is None or (expect_end is not None and entry.tokens != expect_end):
                return None
            if len(out) > 1 << 16:  # a cycle can only come from hostile files
                return None
            out.append(entry)
            expect_end = entry.parent_tokens
            key = entry.parent
        out.reverse()
        return out

    def lookup(self, ns: str, keys: Sequence[PrefixKey], digest: Callable[[int], int],
               *, include_pending: bool = False) -> Lookup:
        """Deepest chain whose text key and token ids both equal a prefix of the prompt.

        ``keys`` are the prompt's grid prefixes (ascending); ``digest(L)`` gives the token
        digest of the prompt's first L tokens (computed only when a key is found).
        """
        result = Lookup()
        for key in reversed(keys):
            entry = self._entries.get((ns, key.sha1))
            if entry is None and include_pending:
                entry = self._pending.get((ns, key.sha1))
            if entry is None:
                if result.miss is None:
                    others = tuple(sorted(self._by_sha1.get(key.sha1, set()) - {ns}))
                    result.miss = Miss.OTHER_NAMESPACE if others else Miss.NO_CHECKPOINT
                    result.miss_key, result.other_namespaces = key, others
                continue
            if entry.tokens != key.tokens or entry.token_digest != digest(key.tokens):
                if result.miss is None or result.miss is Miss.NO_CHECKPOINT:
                    result.miss, result.miss_key = Miss.TOKENS_DIFFER, key
                continue
            chain = self.chain(ns, key.sha1, include_pending=include_pending)
            if chain is None:
                if result.miss is None or result.miss is Miss.NO_CHECKPOINT:
                    result.miss, result.miss_key = Miss.BROKEN_CHAIN, key
                continue
            result.chain = chain
            return result
        return result

    # -- eviction ---------------------------------------------------------------------
    def plan_eviction(self, need_bytes: int, now: float, protected: Iterable[Key] = ()) -> list[Entry]:
        """Leaves to delete, in order, until ``need_bytes`` are freed (or nothing is left)."""
        if need_bytes <= 0:
            return []
        keep = set(protected)
        kids = {k: len(v) for k, v in self._children.items()}
        heap = [(score(e, now), e.last_used, e.ns, e.sha1) for e in self._entries.values()
                if not kids.get(e.key) and e.key not in keep]
        heapq.heapify(heap)
        plan: list[Entry] = []
        freed = 0
        while heap and freed < need_bytes:
            _, _, ns, sha1 = heapq.heappop(heap)
            entry = self._entries[(ns, sha1)]
            plan.append(entry)
            freed += entry.size
            if entry.parent:
                pkey = (ns, entry.parent)
                kids[pkey] = kids.get(pkey, 1) - 1
                parent = self._entries.get(pkey)
                if parent is not None and kids[pkey] == 0 and pkey not in keep:
                    heapq.heappush(heap, (score(parent, now), parent.last_used, ns, parent.sha1))
        return plan
