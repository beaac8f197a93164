"""Changes of checkpoint names as ``ROOT/.journal`` records them (the file itself:
``storage/journal``; its lines: docs/FORMAT.md): the codec of entries and change lines,
checked like any input, and replaying changes onto an :class:`~vllm_kvdisk.core.index.Index`.

A change takes an index whole at the lock's count ``before`` to whole at ``after``; one
that does not start where the index is (a line missing) is a gap, and only a listing of
the directory can close it: ``replay`` says so rather than guess.

Pure: standard library and the core.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.index import Index

FIELDS = (
    "ns",
    "sha1",
    "tokens",
    "parent",
    "parent_tokens",
    "reason",
    "hits",
    "created",
    "last_used",
    "size",
    "token_digest",
    "head",
    "ids_at",
    "inode",
    "mtime_ns",
)


@contextlib.contextmanager
def bulk() -> Iterator[None]:
    """Indexing 100k files at once: the cyclic collector, run every few hundred new
    objects, walked the growing index each time (over half of a start from the journal)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class JournalError(ValueError):
    """The journal cannot be used (torn, foreign, hostile): the store lists instead."""


@dataclass(slots=True)
class Change:
    """One counted change of names: the lock's count ``before`` -> ``after``."""

    before: int
    after: int
    add: list[Entry] = field(default_factory=list)
    remove: list[tuple[str, str, int | None]] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Loaded:
    """A whole journal: the snapshot's entries at ``count``, then the changes after it."""

    count: int
    entries: list[Entry]
    changes: list[Change]


def entry_row(e: Entry) -> list[Any]:
    return [
        e.ns,
        e.sha1,
        e.tokens,
        e.parent,
        e.parent_tokens,
        int(e.reason),
        e.hits,
        e.created,
        e.last_used,
        e.size,
        e.token_digest,
        e.head,
        e.ids_at,
        e.inode,
        e.mtime_ns,
    ]


_NAMES = {16: re.compile(r"[0-9a-f]{16}"), 40: re.compile(r"[0-9a-f]{40}")}
_REASONS = {int(r): r for r in Reason}
_U64 = 1 << 64


def row_entry(row: Any) -> Entry:
    """An entry from its row; JournalError for anything a writer of ours never wrote.
    (The hot loop of a start from the journal: 100k rows; kept to plain checks.)"""
    if type(row) is not list or len(row) != 15:
        raise JournalError("entry row of the wrong shape")
    (
        ns,
        sha1,
        tokens,
        parent,
        parent_tokens,
        reason,
        hits,
        created,
        last_used,
        size,
        token_digest,
        head,
        ids_at,
        inode,
        mtime_ns,
    ) = row
    if not (_hex(ns, 16) and _hex(sha1, 40) and (parent is None or _hex(parent, 40))):
        raise JournalError("entry with a bad name")
    for value in (
        tokens,
        parent_tokens,
        hits,
        created,
        last_used,
        size,
        token_digest,
        head,
        ids_at,
        inode,
        mtime_ns,
    ):
        if type(value) is not int or not 0 <= value < _U64:
            raise JournalError("entry with a bad number")
    if type(reason) is not int or reason not in _REASONS:  # a list would not hash
        raise JournalError("entry with an unknown reason")
    if parent_tokens >= tokens:
        raise JournalError("entry owning no tokens")
    return Entry(
        ns,
        sha1,
        tokens,
        parent,
        parent_tokens,
        _REASONS[reason],
        hits,
        created,
        last_used,
        size,
        token_digest,
        head,
        ids_at,
        inode,
        mtime_ns,
        used_ns=mtime_ns,
    )


def _hex(value: Any, length: int) -> bool:
    return type(value) is str and _NAMES[length].fullmatch(value) is not None


def count_of(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 1 << 64:
        raise JournalError("bad count")
    return value


def change_line(change: Change) -> bytes:
    obj = {
        "before": change.before,
        "after": change.after,
        "add": [entry_row(e) for e in change.add],
        "remove": [list(r) for r in change.remove],
        "gone": list(change.gone),
    }
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def parse_change(line: bytes) -> Change:
    try:
        obj = json.loads(line)
    except ValueError:
        raise JournalError("change line is not JSON") from None
    if not isinstance(obj, dict):
        raise JournalError("change line is not an object")
    change = Change(count_of(obj.get("before")), count_of(obj.get("after")))
    for row in _list(obj.get("add")):
        change.add.append(row_entry(row))
    for row in _list(obj.get("remove")):
        if (
            not isinstance(row, list)
            or len(row) != 3
            or not _hex(row[0], 16)
            or not _hex(row[1], 40)
            or not (row[2] is None or type(row[2]) is int)
        ):
            raise JournalError("bad removal")
        change.remove.append((row[0], row[1], row[2]))
    for ns in _list(obj.get("gone")):
        if not _hex(ns, 16):
            raise JournalError("bad namespace")
        change.gone.append(ns)
    return change


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise JournalError("expected a list")
    return value


def apply(index: Index, change: Change) -> None:
    """Make ``index`` (whole at ``change.before``) whole at ``change.after``. Entries of
    saves in flight stay; an entry of ours for the same file (fresher hits) stays."""
    for ns in change.gone:
        for entry in index.namespace_entries(ns):
            index.remove(ns, entry.sha1)
    for ns, sha1, inode in change.remove:
        known = index.get(ns, sha1)
        if known is not None and (inode is None or known.inode == inode):
            index.remove(ns, sha1)
    for entry in change.add:
        known = index.get(entry.ns, entry.sha1)
        if known is None or (known.inode, known.size) != (entry.inode, entry.size):
            index.add(entry)


def replay(index: Index, at: int | None, got: list[Change] | Loaded) -> int | None:
    """Apply what ``Journal.follow`` or ``load`` returned to ``index``, whole at the count
    ``at`` (None: whole at no known count; only a snapshot can start it). Returns the count
    it is whole at now, or None at a gap (a change line missing: only a listing knows)."""
    changes: list[Change] = got if isinstance(got, list) else got.changes
    if isinstance(got, Loaded) and got.count != at:
        # behind or elsewhere: start again from the snapshot
        for entry in list(index.entries()):
            index.remove(entry.ns, entry.sha1)
        for entry in got.entries:
            index.add(entry)
        at = got.count
    if at is None:
        return None
    for change in changes:
        if change.before != at:
            return None
        apply(index, change)
        at = change.after
    return at
