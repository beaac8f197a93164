"""Which checkpoints go when room is needed: ds4's score, ties by last use, leaves only.

Invariants:
* Only leaves are chosen (no file and no save in flight continues them); a parent becomes
  a leaf once its last child is in the plan, so a parent never goes before its children.
* The files about to be added and their ancestors, and the protected keys, are never chosen.
* Scores within a factor ``SCORE_STEP`` are ties, then least recently used goes first (the
  files of one model differ in tokens per byte only by a little text).
* A checkpoint of a TP engine goes from every rank's namespace at once.
* With a namespace share (``share_bytes``), leaves of namespaces holding more than their
  share (counting the files being added) go first, whatever their score: one tenant
  (cache salt) that fills the budget evicts its own files before anyone else's. A
  namespace that drops to its share meanwhile falls back into the common order.

Pure: it returns a plan; ``budget`` executes it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping

from vllm_kvdisk.core.entry import Entry, Key
from vllm_kvdisk.core.index import Index

HALF_LIFE_S = 6 * 3600
# Eviction scores in one bucket [SCORE_STEP**k, SCORE_STEP**(k+1)) are ties (then LRU):
# buckets, not a distance, so 1.01 and 1.24 tie while 1.24 and 1.26 do not.
SCORE_STEP = 1.25


def score(entry: Entry, now: float) -> float:
    """ds4's keep-worthiness: (decayed hits + 1) x tokens / bytes. Lower goes first."""
    age = max(0.0, now - entry.last_used)
    decayed = entry.hits * math.pow(0.5, age / HALF_LIFE_S)
    return (decayed + 1.0) * entry.tokens / max(1, entry.size)


def eviction_key(entry: Entry, now: float) -> tuple[int, int]:
    """Eviction order: the score in steps of SCORE_STEP (so files of one model, whose
    tokens per byte differ by a little text, count as equal), then least recently used
    (the header's seconds, or the ns the index saw it used or written)."""
    rank = math.floor(math.log(max(score(entry, now), 1e-300), SCORE_STEP))
    return rank, max(entry.used_ns, entry.last_used * 1_000_000_000)


def plan_eviction(
    index: Index,
    need_bytes: int,
    now: float,
    protected: Iterable[Key] = (),
    adding: Iterable[Entry] = (),
    groups: Mapping[str, str] | None = None,
    share_bytes: int = 0,
) -> list[Entry]:
    """Leaves of ``index`` to delete, in order, until ``need_bytes`` are freed (or
    nothing is left).

    ``adding``: files about to become visible; they and their ancestors are not
    leaves for this plan (a delta never evicts its own parent). Pending saves of this
    process count as children too, and ``protected`` keys are never chosen.
    ``groups``: namespace -> its TP group (the namespaces of one engine's ranks): a
    checkpoint goes from every rank's namespace at once, so no rank keeps a file that
    can never load without its siblings (where a sibling is a leaf too).
    ``share_bytes``: each namespace's share of the budget (0: none); leaves of
    namespaces over it are chosen first."""
    if need_bytes <= 0:
        return []
    keep = set(protected)
    kids = index.child_counts()
    for entry in adding:
        keep.add(entry.key)
        if entry.parent and not index.has_child(entry.ns, entry.parent, entry.sha1):
            kids[(entry.ns, entry.parent)] = kids.get((entry.ns, entry.parent), 0) + 1
    groups = groups or {}
    ranks: dict[str, list[str]] = {}
    for ns, group in groups.items():
        ranks.setdefault(group, []).append(ns)
    held: dict[str, int] = {}  # bytes per namespace, with the files being added
    if share_bytes > 0:
        for e in index.entries():
            held[e.ns] = held.get(e.ns, 0) + e.size
        for e in adding:
            held[e.ns] = held.get(e.ns, 0) + e.size

    def tier(ns: str) -> int:  # 0: over its share, goes first
        return 0 if share_bytes > 0 and held.get(ns, 0) > share_bytes else 1

    heap = [
        (tier(e.ns), *eviction_key(e, now), e.ns, e.sha1)
        for e in index.entries()
        if not kids.get(e.key) and e.key not in keep
    ]
    heapq.heapify(heap)
    plan: list[Entry] = []
    planned: set[Key] = set()
    freed = 0
    while heap and freed < need_bytes:
        first, rank, used, ns, sha1 = heapq.heappop(heap)
        if (ns, sha1) in planned:
            continue
        if first != tier(ns):  # its namespace is within its share now
            heapq.heappush(heap, (tier(ns), rank, used, ns, sha1))
            continue
        siblings = ranks[groups[ns]] if ns in groups else [ns]
        for key in [(ns, sha1)] + [(o, sha1) for o in siblings if o != ns]:
            victim = index.get(*key)
            if victim is None or key in planned or kids.get(key) or key in keep:
                continue
            plan.append(victim)
            planned.add(key)
            freed += victim.size
            if share_bytes > 0:
                held[key[0]] -= victim.size
            if victim.parent:
                pkey = (key[0], victim.parent)
                kids[pkey] = kids.get(pkey, 1) - 1
                parent = index.get(*pkey)
                if parent is not None and kids[pkey] == 0 and pkey not in keep:
                    heapq.heappush(heap, (tier(pkey[0]), *eviction_key(parent, now), *pkey))
    return plan
