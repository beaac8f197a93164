"""``ROOT/.journal``: every change of a checkpoint name, in the order of the lock's count,
so a store learns what other processes changed by reading a few lines instead of listing
the namespaces, and starts from one file instead of reading every file's header (a
listing of 100k files takes seconds on a network file system, reading their headers
minutes).

* One JSON object per line. The first line is the header: the version, the entry fields,
  the lock count the snapshot is whole at (``count``), how many entries follow it, and
  the byte offset where the change lines start. Then one line per entry (a JSON list in
  the order of ``fields``), then one line per counted change: ``before`` and ``after``
  (the lock's count around it) and what it did: ``add`` (entries), ``remove`` ([ns,
  sha1, inode or null]) and ``gone`` (namespaces removed).
* Lines are appended under ``ROOT/.lock`` after the count moved (``DirLock.count_change``),
  one ``write`` each. A writer killed between the count and its line leaves a gap: a
  reader that cannot chain ``before`` to the count it is at knows it missed something and
  lists the directory (or reloads the snapshot), never guesses.
* The snapshot is rewritten (``compact``) under the lock, as a temp file renamed over the
  journal, by a store whose index is whole at the lock's count, when the change lines
  outgrow it. A reader that finds another file under the name starts from its snapshot,
  or skips it when it is at the snapshot's count already.
* The journal is a hint, never the truth: a file it names may be gone (a lookup misses,
  an eviction stats its victims first) and a file saved by a writer killed before its line
  is not in it (the background reconcile after a start-up from the journal lists the
  directory once). A torn, foreign or hostile journal is not used: the store lists.

Pure: standard library.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.index import Index
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir

log = get_logger(__name__)

NAME = ".journal"
VERSION = 1
FIELDS = ("ns", "sha1", "tokens", "parent", "parent_tokens", "reason", "hits", "created",
          "last_used", "size", "token_digest", "head", "ids_at", "inode", "mtime_ns")
MAX_HEADER_BYTES = 4096
MAX_LINE_BYTES = 64 << 20  # one change line; an eviction of many files is one line
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


def _count(value: Any) -> int:
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
    change = Change(_count(obj.get("before")), _count(obj.get("after")))
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


def _lines(data: bytes) -> tuple[list[bytes], int]:
    """Complete lines of ``data`` and how many bytes they take (a torn last line, being
    written or left by a killed writer, is not one)."""
    end = data.rfind(b"\n") + 1
    return data[:end].split(b"\n")[:-1], end


class Journal:
    """A store's reader and writer of ``ROOT/.journal``: where it read up to, and the
    appends and snapshots it makes under the lock."""

    def __init__(self, root_fd: int, *, readonly: bool = False):
        self.root_fd = root_fd
        self.readonly = readonly
        self.lines = 0  # change lines after the snapshot, as far as this store read
        self._at: tuple[int, int] | None = None  # (inode, offset) read up to

    # -- reading ----------------------------------------------------------------------
    def _open(self) -> int:
        return fsdir.open_regular(NAME, self.root_fd)

    @staticmethod
    def _read_all(fd: int, offset: int) -> bytes:
        # Another client's appends may not be in this client's cached pages (GlusterFS).
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        if size - offset > MAX_LINE_BYTES * 64:
            raise JournalError(f"journal of {size} bytes")
        chunks = []
        while offset < size:
            chunk = os.pread(fd, min(size - offset, 16 << 20), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)

    @staticmethod
    def _header(fd: int) -> dict:
        head = os.pread(fd, MAX_HEADER_BYTES, 0)
        end = head.find(b"\n")
        if end < 0:
            raise JournalError("no header line")
        try:
            obj = json.loads(head[:end])
        except ValueError:
            raise JournalError("header is not JSON") from None
        if not isinstance(obj, dict) or obj.get("kvdisk_journal") != VERSION:
            raise JournalError("not a journal of this version")
        if obj.get("fields") != list(FIELDS):
            raise JournalError("other entry fields")
        for key in ("count", "entries", "changes_at"):
            _count(obj.get(key))
        return obj

    def load(self) -> Loaded | None:
        """The whole journal (None: there is none, or it cannot be used; logged). Reading
        it is where this store's reading starts."""
        try:
            fd = self._open()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("kvdisk: journal not used: %s", exc)
            return None
        try:
            header = self._header(fd)
            data = self._read_all(fd, 0)
            lines, used = _lines(data)
            want = int(header["entries"])
            if len(lines) < want + 1 or sum(len(x) + 1 for x in lines[:want + 1]) != int(
                    header["changes_at"]):
                raise JournalError("snapshot shorter than its header says")
            entries = []
            for line in lines[1:want + 1]:
                try:
                    entries.append(row_entry(json.loads(line)))
                except ValueError:
                    raise JournalError("entry line is not JSON") from None
            changes = [parse_change(line) for line in lines[want + 1:]]
            self._at = (os.fstat(fd).st_ino, used)
            self.lines = len(changes)
            return Loaded(int(header["count"]), entries, changes)
        except (JournalError, OSError, RecursionError) as exc:
            log.warning("kvdisk: journal %s/%s not used: %s", self._root_name(), NAME, exc)
            with contextlib.suppress(OSError):
                self._at = (os.fstat(fd).st_ino, -1)  # not read again until replaced
            return None
        finally:
            os.close(fd)

    def follow(self) -> list[Change] | Loaded | None:
        """What was appended since this store last read: the new change lines; the whole
        journal (``Loaded``) when another file is under the name now (a snapshot); None
        when it cannot be read now (the caller lists when it needs to be whole)."""
        if self._at is None:
            return self.load()
        try:
            fd = self._open()
        except OSError:
            return None
        try:
            inode, offset = self._at
            if os.fstat(fd).st_ino != inode:
                os.close(fd)
                fd = -1
                return self.load()
            data = self._read_all(fd, offset)
            lines, used = _lines(data)
            self._at = (inode, offset + used)  # a bad line is not read twice
            changes = [parse_change(line) for line in lines]
            self.lines += len(changes)
            return changes
        except (JournalError, OSError, RecursionError) as exc:
            log.warning("kvdisk: journal not followed: %s", exc)
            return None
        finally:
            if fd >= 0:
                os.close(fd)

    def skip_to_end(self) -> None:
        """Under the lock, after a listing: every line there is reflected already."""
        try:
            fd = self._open()
        except OSError:
            self._at = None
            return
        try:
            self._at = (os.fstat(fd).st_ino, self._complete_end(fd))
        except OSError:
            self._at = None
        finally:
            os.close(fd)

    @staticmethod
    def _complete_end(fd: int) -> int:
        """The offset after the last complete line (reading back from the end: one byte
        when the file ends with a whole line, as it does unless a writer was killed)."""
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return size
        end = size - 1
        while end > 0:
            start = max(0, end - (64 << 10))
            at = os.pread(fd, end - start, start).rfind(b"\n")
            if at >= 0:
                return start + at + 1
            end = start
        return 0

    def replaced(self) -> bool:
        """Whether another file than the one this store read is under the name now (a
        rewritten snapshot): a store that lost the thread may start again from it (one
        that never read the journal does not: it scanned, and lists)."""
        if self._at is None:
            return False
        try:
            st = os.stat(NAME, dir_fd=self.root_fd, follow_symlinks=False)
        except OSError:
            return False
        return st.st_ino != self._at[0]

    # -- writing (under the lock) -----------------------------------------------------
    def append(self, change: Change) -> bool:
        """Add a change line to the journal there is (none: nothing; the next compaction
        writes one). False if it could not be written (readers will find the gap)."""
        if self.readonly:
            return False
        try:
            fd = fsdir.open_regular(NAME, self.root_fd, flags=os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("kvdisk: journal not appended to: %s", exc)
            return False
        try:
            st = os.fstat(fd)
            if st.st_nlink != 1:
                return False  # someone else's file linked here: never write through it
            end = self._complete_end(fd)
            line = change_line(change)
            if end != st.st_size:
                line = b"\n" + line  # a killed writer's torn line stays one bad line
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            if self._at is not None and self._at == (st.st_ino, end):
                self._at = (st.st_ino, st.st_size + len(line))  # read our own line already
                self.lines += 1
            return True
        except OSError as exc:
            log.warning("kvdisk: journal not appended to: %s", exc)
            return False
        finally:
            os.close(fd)

    def compact(self, count: int, entries: Iterable[Entry]) -> bool:
        """Write a new journal whose snapshot is ``entries`` at ``count`` (the caller's
        index, whole at the lock's count), atomically; this store has read it all."""
        if self.readonly:
            return False
        rows = [json.dumps(entry_row(e), separators=(",", ":")).encode() + b"\n"
                for e in entries if not e.pending]
        body = b"".join(rows)
        header = b""
        for _ in range(3):  # the offset is written in the header that precedes it
            obj = {"kvdisk_journal": VERSION, "fields": list(FIELDS), "count": count,
                   "entries": len(rows), "changes_at": len(header) + len(body)}
            header = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        try:
            with fsdir.TempFile(self.root_fd, NAME) as tmp:
                tmp.write([header, body])
                inode = tmp.stat().st_ino
                tmp.commit()
        except OSError as exc:
            log.warning("kvdisk: journal not rewritten: %s", exc)
            return False
        self._at = (inode, len(header) + len(body))
        self.lines = 0
        return True

    def _root_name(self) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{self.root_fd}")
        except OSError:
            return "cache"


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
