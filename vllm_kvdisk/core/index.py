"""In-memory index of the checkpoints on disk: its tables, two-phase saves, chains, and
the lookup walk (entries: ``entry``; eviction plans: ``eviction``).

A file owns the blocks ``[start, end)`` of one token sequence (``start`` = its parent's
share, 0 for a root) and stores the token ids of the whole prefix ``[0, end)``. Its parent
is the file whose chain covers ``[0, start)``; the parent may end *after* ``start`` (a
branch inside the parent: two sessions that share a system prompt and diverge in the
middle of a file share that file's blocks).

Invariants:
* An entry is in the index only once its file is complete. Saves in flight are
  ``pending`` entries: visible to save planning (parents, duplicates), never to lookups.
* A lookup walks from the roots along parent links: at position ``pos`` under node ``N``
  the candidates are the children of ``N`` that start at ``pos`` and whose first block has
  the prompt's ids (``head``, an xxh3-64 of that block). A candidate counts whole when the
  xxh3-64 of the prompt's ids ``[0, end)`` equals the file's token digest, partly up to the
  last block both agree on (read from the file's stored ids). Rendered text is never
  needed to find a checkpoint; the worker compares every restored file's stored ids with
  the prompt's before a page counts as loaded.
* A chain whose parent is missing is unreachable (never a hit). Eviction (``eviction``)
  removes leaves only, so a parent never goes before its children.

Pure: no I/O (the caller passes a function that reads a file's stored ids). It returns
decisions; ``store.Store`` executes them.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import xxhash

from vllm_kvdisk.core.entry import Entry, Key

# Candidate checks per lookup that did not extend the path by a whole file (a digest that
# differs, a partial read of stored ids): bounds what hostile trees can cost. A whole
# match is not counted: each file is visited at most once per lookup (it is a candidate
# only under its own parent), so a chain of any length restores completely, at a cost
# linear in its length.
MAX_WALK_STEPS = 512

# Roots a lookup that matched none looks at to name the nearest (diagnostics only).
MAX_ROOTS_COMPARED = 512

IdsReader = Callable[[Entry, int, int], "np.ndarray | None"]


class Miss(str, Enum):  # noqa: UP042 - str() and format() of the members stay as they are
    """Why a lookup found nothing deeper; ``label`` is the metric label value."""

    NO_CHECKPOINT = "no checkpoint"
    BELOW_MIN_TOKENS = "below min tokens"
    PREFIX_MISMATCH = "prefix mismatch"
    TOKENS_DIFFER = "text equal but tokens differ"
    OTHER_NAMESPACE = "checkpoint of another model/layout/dtype of the same tenant"
    CHEAPER_TO_RECOMPUTE = "cheaper to recompute"
    WINDOW_NOT_STORED = "sliding window not stored at the prompt's position"
    STATE_NOT_STORED = "linear-attention state not stored at the prompt's position"
    SKIPPED = "loading skipped by the request"

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Segment:
    """The part of one file a restore uses: its blocks [entry.parent_tokens, upto)."""

    entry: Entry
    upto: int

    @property
    def whole(self) -> bool:
        return self.upto == self.entry.tokens


# A lookup's path as a linked list (its last segment, the path before it): extending a
# path costs O(1), not a copy of every segment before it (quadratic in a long chain).
_Path = tuple[Segment, "_Path"] | None


@dataclass(slots=True)
class Lookup:
    """The deepest usable chain for a prompt, or why there is none deeper."""

    segments: list[Segment] = field(default_factory=list)
    miss: Miss | None = None  # why not deeper
    # Files under the deepest node that the prompt leaves (diagnostics only); with no
    # node at all (no checkpoint starts like the prompt), the namespace's newest roots.
    diverged: list[Entry] = field(default_factory=list)
    other_namespaces: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        return self.segments[-1].upto if self.segments else 0

    @property
    def chain(self) -> list[Entry]:
        return [s.entry for s in self.segments]

    def cut(self, count: int, miss: Miss) -> Lookup:
        """The same lookup with only its first ``count`` segments."""
        return Lookup(self.segments[:count], miss, self.diverged, self.other_namespaces)

    def cut_at(self, tokens: int, miss: Miss) -> Lookup:
        """The same lookup ending at ``tokens`` (a block boundary inside it)."""
        segments = [
            s if s.upto <= tokens else Segment(s.entry, tokens)
            for s in self.segments
            if s.entry.parent_tokens < tokens
        ]
        return Lookup(segments, miss, self.diverged, self.other_namespaces)


def common_blocks(a: np.ndarray, b: np.ndarray, block_size: int) -> int:
    """Tokens of the longest whole-block common prefix of two id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    same = int(differ[0]) if differ.size else n
    return same - same % block_size


class Index:
    def __init__(self) -> None:
        self._entries: dict[Key, Entry] = {}
        self._by_ns: dict[str, dict[str, Entry]] = {}
        self._pending: dict[Key, Entry] = {}
        # parent key -> sha1s of its children (files and pending saves)
        self._children: dict[Key, set[str]] = {}
        # (ns, parent sha1 or "", start) -> {head -> entries that continue there}
        self._next: dict[tuple[str, str, int], dict[int, list[Entry]]] = {}
        self._roots: dict[int, set[str]] = {}  # head of a root -> namespaces that hold one
        self.total_bytes = 0

    def clear(self) -> None:
        """Forget everything (the same object stays shared with planners)."""
        for table in (
            self._entries,
            self._by_ns,
            self._pending,
            self._children,
            self._next,
            self._roots,
        ):
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

    def keys(self) -> Iterable[Key]:
        return self._entries.keys()

    def namespace_entries(self, ns: str) -> list[Entry]:
        return list(self._by_ns.get(ns, {}).values())

    def namespaces(self) -> list[str]:
        """Namespaces that hold at least one indexed file."""
        return list(self._by_ns)

    def _link(self, entry: Entry) -> None:
        self._children.setdefault((entry.ns, entry.parent or ""), set()).add(entry.sha1)
        at = self._next.setdefault((entry.ns, entry.parent or "", entry.parent_tokens), {})
        at.setdefault(entry.head, []).append(entry)
        if entry.parent is None and not entry.pending:
            self._roots.setdefault(entry.head, set()).add(entry.ns)

    def _unlink(self, entry: Entry) -> None:
        parent_key = (entry.ns, entry.parent or "")
        kids = self._children.get(parent_key)
        if kids is not None:
            kids.discard(entry.sha1)
            if not kids:
                del self._children[parent_key]
        at_key = (entry.ns, entry.parent or "", entry.parent_tokens)
        at = self._next.get(at_key, {})
        bucket = [e for e in at.get(entry.head, ()) if e is not entry]
        if bucket:
            at[entry.head] = bucket
        else:
            at.pop(entry.head, None)
            if not at:
                self._next.pop(at_key, None)
        if entry.parent is None and not entry.pending and not any(not e.pending for e in bucket):
            spaces = self._roots.get(entry.head)
            if spaces is not None:
                spaces.discard(entry.ns)
                if not spaces:
                    del self._roots[entry.head]

    def add(self, entry: Entry) -> None:
        """Index a complete file (replacing any entry or pending save of the same key)."""
        entry.pending, entry.ids = False, None
        key = (entry.ns, entry.sha1)
        if key in self._entries:
            self.remove(entry.ns, entry.sha1)
        if key in self._pending:
            self.release(entry.ns, entry.sha1)
        self._entries[key] = entry
        self._by_ns.setdefault(entry.ns, {})[entry.sha1] = entry
        self.total_bytes += entry.size
        self._link(entry)

    def remove(self, ns: str, sha1: str) -> Entry | None:
        entry = self._entries.pop((ns, sha1), None)
        if entry is None:
            return None
        in_ns = self._by_ns[ns]
        del in_ns[sha1]
        if not in_ns:
            del self._by_ns[ns]
        self.total_bytes -= entry.size
        self._unlink(entry)
        return entry

    def children(self, ns: str, sha1: str | None) -> list[Entry]:
        """Files (not pending saves) whose parent is ``sha1`` (None: the roots)."""
        names = self._children.get((ns, sha1 or ""), ())
        return [self._entries[(ns, s)] for s in names if (ns, s) in self._entries]

    def descendants(self, ns: str, sha1: str) -> list[Entry]:
        """Files (not pending saves) whose chain passes through ``sha1``: its children,
        theirs, and so on (each once, even in a hostile cycle), parents before children."""
        out: list[Entry] = []
        seen = {sha1}
        todo = [sha1]
        while todo:
            for child in self.children(ns, todo.pop(0)):
                if child.sha1 not in seen:
                    seen.add(child.sha1)
                    out.append(child)
                    todo.append(child.sha1)
        return out

    def has_child(self, ns: str, parent: str, sha1: str) -> bool:
        return sha1 in self._children.get((ns, parent), ())

    def child_counts(self) -> dict[Key, int]:
        """Parent key -> how many files and saves in flight continue it."""
        return {
            (ns, parent): len(names) for (ns, parent), names in self._children.items() if parent
        }

    # -- two-phase saves --------------------------------------------------------------
    def reserve(self, entry: Entry) -> bool:
        """Mark a save in flight. False if the key is already on disk or in flight; a file
        whose chain is broken (an orphan: nothing can load it) does not hold its name,
        the save replaces it (the store deletes it under the lock, ``Budget``)."""
        if entry.key in self._pending or (
            entry.key in self._entries and self.chain(entry.ns, entry.sha1) is not None
        ):
            return False
        entry.pending = True
        self._pending[entry.key] = entry
        self._link(entry)
        return True

    def release(self, ns: str, sha1: str) -> None:
        """The save in flight failed or was abandoned."""
        entry = self._pending.pop((ns, sha1), None)
        if entry is not None:
            self._unlink(entry)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def pending(self, ns: str, sha1: str) -> Entry | None:
        return self._pending.get((ns, sha1))

    # -- chains -----------------------------------------------------------------------
    def chain(self, ns: str, sha1: str) -> list[Entry] | None:
        """Files root -> sha1, or None if a link is missing or inconsistent (the child must
        start inside its parent: parent.start < child.start <= parent.end)."""
        out: list[Entry] = []
        key: str | None = sha1
        start: int | None = None
        while key is not None:
            entry = self._entries.get((ns, key))
            if entry is None or len(out) > 1 << 16:  # a cycle can only come from hostile files
                return None
            if start is not None and not entry.parent_tokens < start <= entry.tokens:
                return None
            out.append(entry)
            start = entry.parent_tokens
            key = entry.parent
        out.reverse()
        return out

    def orphans(self) -> list[Entry]:
        """Files whose chain is broken (``chain`` would say None), each link looked at
        once: a verdict is remembered for every file on the way to a root or a break, so
        a chain of n files costs n steps, not n^2 / 2."""
        sound: dict[Key, bool] = {}
        out: list[Entry] = []
        for entry in list(self._entries.values()):
            path: list[Entry] = []
            on_path: set[str] = set()
            e = entry
            while True:
                known = sound.get(e.key)
                if known is not None:
                    verdict = known
                    break
                path.append(e)
                on_path.add(e.sha1)
                if e.parent is None:
                    verdict = True
                    break
                parent = self._entries.get((e.ns, e.parent))
                if (
                    parent is None
                    or parent.sha1 in on_path  # a cycle: hostile files
                    or not parent.parent_tokens < e.parent_tokens <= parent.tokens
                ):
                    verdict = False
                    break
                e = parent
            for seen in path:
                sound[seen.key] = verdict
                if not verdict:
                    out.append(seen)
        return out

    @staticmethod
    def segments_of(chain: Sequence[Entry]) -> list[Segment]:
        """The blocks each file of a chain contributes: up to where its child starts."""
        ends = [e.parent_tokens for e in chain[1:]] + [chain[-1].tokens] if chain else []
        return [Segment(e, upto) for e, upto in zip(chain, ends)]

    # -- lookups ----------------------------------------------------------------------
    def lookup(
        self,
        ns: str,
        ids: np.ndarray,
        limit: int,
        block_size: int,
        read_ids: IdsReader,
        *,
        include_pending: bool = False,
        peers: Callable[[str], bool] | None = None,
    ) -> Lookup:
        """Deepest chain whose stored ids equal the prompt's ``ids[0:L]``, L <= ``limit``
        a block boundary; whole files by token digest, a partly matching file up to its
        last matching block. ``peers(other)``: whether a miss may name namespace
        ``other`` as holding the prompt's first block (``OTHER_NAMESPACE``); only the
        namespaces of the same tenant may be named (see ``_explain``)."""
        ids = np.ascontiguousarray(ids, dtype="<u4")
        raw = ids.data.cast("B")
        limit = min(limit, len(ids))
        limit -= limit % block_size
        best: tuple[int, int, _Path] = (0, 0, None)  # (tokens, -files, path)
        wasted = 0
        # Depth-first over candidates: (node sha1 or "", pos, hasher over [0, pos), files,
        # path)
        stack: list[tuple[str, int, xxhash.xxh3_64, int, _Path]] = [
            ("", 0, xxhash.xxh3_64(), 0, None)
        ]
        while stack:
            node, pos, hasher, files, path = stack.pop()
            if (pos, -files) > best[:2]:
                best = (pos, -files, path)
            at = self._next.get((ns, node, pos))
            if at is None or pos + block_size > limit:
                continue
            head = xxhash.xxh3_64_intdigest(raw[4 * pos : 4 * (pos + block_size)])
            for cand in at.get(head, ()):
                if wasted >= MAX_WALK_STEPS:
                    break
                if cand.pending and not include_pending:
                    continue
                if cand.tokens <= limit:
                    whole = hasher.copy()
                    whole.update(raw[4 * pos : 4 * cand.tokens])
                    if whole.intdigest() == cand.token_digest:
                        stack.append(
                            (
                                cand.sha1,
                                cand.tokens,
                                whole,
                                files + 1,
                                (Segment(cand, cand.tokens), path),
                            )
                        )
                        continue
                wasted += 1
                upto = self._partial(cand, ids, pos, limit, block_size, read_ids)
                if upto > pos:
                    part = hasher.copy()
                    part.update(raw[4 * pos : 4 * upto])
                    stack.append((cand.sha1, upto, part, files + 1, (Segment(cand, upto), path)))
        segments: list[Segment] = []
        link = best[2]
        while link is not None:
            segments.append(link[0])
            link = link[1]
        segments.reverse()
        result = Lookup(segments)
        self._explain(ns, result, ids, block_size, limit, peers)
        return result

    @staticmethod
    def _partial(
        cand: Entry, ids: np.ndarray, pos: int, limit: int, block_size: int, read_ids: IdsReader
    ) -> int:
        stop = min(cand.tokens, limit)
        theirs: np.ndarray | None
        if cand.pending and cand.ids is not None:  # a save in flight: its ids are in memory
            theirs = cand.ids[pos:stop]
        else:
            theirs = read_ids(cand, pos, stop)
        if theirs is None:
            return pos
        return pos + common_blocks(ids[pos:stop], theirs, block_size)

    def _recent_roots(self, ns: str, count: int) -> list[Entry]:
        """The ``count`` most recently used of (at most ``MAX_ROOTS_COMPARED``) root files
        of ``ns``: bounded work in the engine's step, whatever the namespace holds."""
        roots = (e for bucket in self._next.get((ns, "", 0), {}).values() for e in bucket)
        some = itertools.islice((e for e in roots if not e.pending), MAX_ROOTS_COMPARED)
        return heapq.nlargest(count, some, key=lambda e: e.used_ns)

    def _explain(
        self,
        ns: str,
        result: Lookup,
        ids: np.ndarray,
        block_size: int,
        limit: int,
        peers: Callable[[str], bool] | None,
    ) -> None:
        """Why the deepest path did not go further (for metrics and the trace). Only
        namespaces ``peers`` accepts are compared with the prompt: the reason for a miss
        under one cache salt never says that another salt's files hold the prompt's
        prefix (that would confirm another tenant's prompt to whoever reads the metrics
        or the trace). Without ``peers``, no other namespace is looked at."""
        end = result.tokens
        last = result.segments[-1] if result.segments else None
        below: list[Entry] = []
        if last is not None:  # files that start where the hit ends, whatever their head
            for bucket in self._next.get((ns, last.entry.sha1, end), {}).values():
                below += [e for e in bucket if not e.pending][: 8 - len(below)]
        if last is not None and not last.whole and end < limit:
            result.miss = Miss.PREFIX_MISMATCH  # the prompt leaves this file inside it
            result.diverged = [last.entry] + below
        elif below and end < limit:
            result.miss = Miss.PREFIX_MISMATCH  # deeper checkpoints exist; none continues
            result.diverged = below
        elif not result.segments and len(ids) >= block_size:
            others: tuple[str, ...] = ()
            if peers is not None:
                head = xxhash.xxh3_64_intdigest(np.ascontiguousarray(ids[:block_size]).tobytes())
                others = tuple(sorted(o for o in self._roots.get(head, set()) - {ns} if peers(o)))
            result.miss = Miss.OTHER_NAMESPACE if others else Miss.NO_CHECKPOINT
            result.other_namespaces = others
            if not others:  # the roots the prompt leaves in its first block: diagnostics only
                result.diverged = self._recent_roots(ns, 8)
        else:
            result.miss = Miss.NO_CHECKPOINT
