"""Changes of checkpoint names as ``ROOT/.journal`` records them (the file itself:
``storage/journal``; its lines: docs/FORMAT.md): the codec of entries and change lines,
checked like any input, and replaying changes onto an :class:`~vllm_kvdisk.core.index.Index`.

A change takes an index whole at the lock's count ``before`` to whole at ``after``; one
that does not start where the index is (a line missing) is a gap, and only a listing of
the directory can close it: ``replay`` says so rather than guess.

Pure: standard library and the core.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.index import Index

FIELDS = ("ns", "sha1", "tokens", "parent", "parent_tokens", "reason", "hits", "created",
          "last_used", "size", "token_digest", "head", "ids_at", "inode", "mtime_ns")
_INTS = tuple(f for f in FIELDS if f not in ("ns", "sha1", "parent", "reason"))


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
    return [e.ns, e.sha1, e.tokens, e.parent, e.parent_tokens, int(e.reason), e.hits,
            e.created, e.last_used, e.size, e.token_digest, e.head, e.ids_at, e.inode,
            e.mtime_ns]


def row_entry(row: Any) -> Entry:
    """An entry from its row; JournalError for anything a writer of ours never wrote."""
    if not isinstance(row, list) or len(row) != len(FIELDS):
        raise JournalError("entry row of the wrong shape")
    d = dict(zip(FIELDS, row))
    if not (_hex(d["ns"], 16) and _hex(d["sha1"], 40)
            and (d["parent"] is None or _hex(d["parent"], 40))):
        raise JournalError("entry with a bad name")
    if not all(type(d[f]) is int and 0 <= d[f] < 1 << 64 for f in _INTS):
        raise JournalError("entry with a bad number")
    try:
        reason = Reason(d["reason"])
    except ValueError:
        raise JournalError("entry with an unknown reason") from None
    if not 0 <= d["parent_tokens"] < d["tokens"]:
        raise JournalError("entry owning no tokens")
    return Entry(d["ns"], d["sha1"], d["tokens"], d["parent"], d["parent_tokens"], reason,
                 d["hits"], d["created"], d["last_used"], d["size"], d["token_digest"],
                 d["head"], d["ids_at"], d["inode"], d["mtime_ns"], used_ns=d["mtime_ns"])


def _hex(value: Any, length: int) -> bool:
    return (isinstance(value, str) and len(value) == length
            and all(c in "0123456789abcdef" for c in value))


def count_of(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 1 << 64:
        raise JournalError("bad count")
    return value


def change_line(change: Change) -> bytes:
    obj = {"before": change.before, "after": change.after,
           "add": [entry_row(e) for e in change.add],
           "remove": [list(r) for r in change.remove], "gone": list(change.gone)}
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
        if (not isinstance(row, list) or len(row) != 3 or not _hex(row[0], 16)
                or not _hex(row[1], 40) or not (row[2] is None or type(row[2]) is int)):
            raise JournalError("bad removal")
        change.remove.append((row[0], row[1], row[2]))
    for ns in _list(obj.get("gone")):
        if not _hex(ns, 16):
            raise JournalError("bad namespace")
        change.gone.append(ns)
    return change


def _list(value: Any) -> list:
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
        entry = index.get(ns, sha1)
        if entry is not None and (inode is None or entry.inode == inode):
            index.remove(ns, sha1)
    for entry in change.add:
        known = index.get(entry.ns, entry.sha1)
        if known is None or (known.inode, known.size) != (entry.inode, entry.size):
            index.add(entry)


def replay(index: Index, at: int | None, got: list[Change] | Loaded) -> int | None:
    """Apply what ``Journal.follow`` or ``load`` returned to ``index``, whole at the count
    ``at`` (None: whole at no known count; only a snapshot can start it). Returns the count
    it is whole at now, or None at a gap (a change line missing: only a listing knows)."""
    changes = got
    if isinstance(got, Loaded):
        changes = got.changes
        if got.count != at:  # behind or elsewhere: start again from the snapshot
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
