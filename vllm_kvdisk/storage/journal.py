"""``ROOT/.journal``: every change of a checkpoint name, in the order of the lock's count,
so a store learns what other processes changed by reading a few lines instead of listing
the namespaces, and starts from one file instead of reading every file's header (a
listing of 100k files takes seconds on a network file system, reading their headers
minutes).

* One JSON object per line. The first line is the header: the version, the entry fields,
  the lock count the snapshot is whole at (``count``), how many entries follow it, the
  byte offset where the change lines start, and the journal's generation (``id``, 16
  random hex digits, new at every rewrite). A journal is this store's journal by
  (inode, generation), never its inode alone: ext4 hands a freed inode to the next
  file, so after two rewrites the new journal can be on the inode a reader remembers,
  and read from that reader's old offset it said nothing new (and a writer's append
  went past the end, where no reader looks). Then one line per entry (a JSON list in
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
import re
import secrets
from collections.abc import Iterable
from typing import Any

from vllm_kvdisk.core.changes import (
    FIELDS,
    Change,
    JournalError,
    Loaded,
    change_line,
    count_of,
    entry_row,
    parse_change,
    row_entry,
)
from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir

log = get_logger(__name__)

NAME = ".journal"
VERSION = 2  # 2: the header's generation ``id``
_GENERATION = re.compile(r"[0-9a-f]{16}")
MAX_HEADER_BYTES = 4096
MAX_BYTES = 1 << 30  # a journal read at once (~0.3 KB per checkpoint: 3M checkpoints)
MIN_ROOM = 16 << 20  # a new journal's size: its snapshot, then zeros for change lines
READ_CHUNK = 16 << 20


def _lines(data: bytes) -> tuple[list[bytes], int]:
    """Complete lines of ``data`` and how many bytes they take (a torn last line, being
    written or left by a killed writer, is not one)."""
    end = data.rfind(b"\n") + 1
    return data[:end].split(b"\n")[:-1], end


class Journal:
    """A store's reader and writer of ``ROOT/.journal``: where it read up to, and the
    appends and snapshots it makes under the lock."""

    def __init__(self, root_fd: int, *, readonly: bool = False, drop_cache: bool = True):
        self.root_fd = root_fd
        self.readonly = readonly
        self.drop_cache = drop_cache  # reads ask the volume (``fsdir.drops_cache``)
        self.lines = 0  # change lines after the snapshot, as far as this store read
        # ((inode, generation) of the journal read, the offset read up to; -1: not used)
        self._at: tuple[tuple[int, str], int] | None = None

    # -- reading ----------------------------------------------------------------------
    def _open(self, flags: int = os.O_RDONLY) -> int:
        # Written in place only if no other name links to it (someone else's file).
        return fsdir.open_regular(NAME, self.root_fd, flags=flags, single_link=flags != os.O_RDONLY)

    def _open_or_none(self, flags: int, doing: str) -> int | None:
        """The journal's descriptor; None if there is none, or it cannot be opened (logged)."""
        try:
            return self._open(flags)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("kvdisk: journal not %s: %s", doing, exc)
            return None

    def _read_all(self, fd: int, offset: int) -> bytes:
        """The bytes from ``offset`` up to the first zero byte (the end of what was
        written: the file is preallocated, so its size never moves and no client's
        cached size hides another's lines), read from the volume, not cached pages."""
        if self.drop_cache:
            fsdir.drop_cached(fd, offset)
        chunks, total, want = [], 0, 16 << 10  # new lines are few: small reads first
        while True:
            chunk = os.pread(fd, want, offset + total)
            zero = chunk.find(0)
            if zero >= 0:
                chunk = chunk[:zero]
            chunks.append(chunk)
            total += len(chunk)
            if zero >= 0 or len(chunk) < want:
                return b"".join(chunks)
            if total > MAX_BYTES:
                raise JournalError(f"journal of over {MAX_BYTES} bytes")
            want = min(want * 4, READ_CHUNK)

    @staticmethod
    def _header(fd: int) -> dict[str, Any]:
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
            count_of(obj.get(key))
        gen = obj.get("id")
        if not isinstance(gen, str) or _GENERATION.fullmatch(gen) is None:
            raise JournalError("no generation")
        count_of(obj.get("root"))
        return obj

    def _ident(self, fd: int) -> tuple[int, str]:
        """(inode, generation) of the journal open as ``fd``; JournalError, OSError."""
        if self.drop_cache:
            fsdir.drop_cached(fd, 0, MAX_HEADER_BYTES)
        return os.fstat(fd).st_ino, str(self._header(fd)["id"])

    def _offset(self, fd: int) -> int:
        """Where this store read up to in the journal open as ``fd``: 0 if it is another
        journal than the one read (or the offset is unknown)."""
        if self._at is None or self._at[1] < 0:
            return 0
        try:
            return self._at[1] if self._ident(fd) == self._at[0] else 0
        except JournalError:
            return 0

    def load(self) -> Loaded | None:
        """The whole journal (None: there is none, or it cannot be used; logged). Reading
        it is where this store's reading starts."""
        fd = self._open_or_none(os.O_RDONLY, "used")
        if fd is None:
            return None
        try:
            header = self._header(fd)
            if header["root"] != os.fstat(self.root_fd).st_ino:
                # Copied or restored into another directory: its entries' inodes are the
                # old volume's (hits not counted, stored ids not read): list instead.
                raise JournalError("written for another directory (a copied cache?)")
            data = self._read_all(fd, 0)
            want = int(header["entries"])
            # Counted before split: a hostile file of short lines would take GBs as objects.
            if data.count(b"\n") > want + 1 + 8 * max(4096, want):
                raise JournalError("more change lines than any writer leaves")
            lines, used = _lines(data)
            if len(lines) < want + 1 or sum(len(x) + 1 for x in lines[: want + 1]) != int(
                header["changes_at"]
            ):
                raise JournalError("snapshot shorter than its header says")
            try:  # one parse of every row (a call per row cost more than the rows)
                rows = json.loads(b"[" + b",".join(lines[1 : want + 1]) + b"]")
            except ValueError:
                raise JournalError("an entry line is not JSON") from None
            if len(rows) != want:  # a line holding two rows
                raise JournalError("entry lines do not match the header")
            entries = [row_entry(row) for row in rows]
            changes = [parse_change(line) for line in lines[want + 1 :]]
            self._at = ((os.fstat(fd).st_ino, str(header["id"])), used)
            self.lines = len(changes)
            return Loaded(int(header["count"]), entries, changes)
        except (JournalError, OSError, RecursionError) as exc:
            log.warning("kvdisk: journal not used: %s", exc)
            with contextlib.suppress(OSError):  # not read again until replaced
                try:
                    self._at = (self._ident(fd), -1)
                except JournalError:
                    self._at = ((os.fstat(fd).st_ino, ""), -1)
            return None
        finally:
            fsdir.close_read(fd)

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
            ident, offset = self._at
            if self._ident(fd) != ident:
                fsdir.close_read(fd)
                fd = -1
                return self.load()
            if offset < 0:
                return None  # a journal this store could not use
            data = self._read_all(fd, offset)
            lines, used = _lines(data)
            self._at = (ident, offset + used)  # a bad line is not read twice
            changes = [parse_change(line) for line in lines]
            self.lines += len(changes)
            return changes
        except (JournalError, OSError, RecursionError) as exc:
            log.warning("kvdisk: journal not followed: %s", exc)
            return None
        finally:
            if fd >= 0:
                fsdir.close_read(fd)

    def skip_to_end(self) -> None:
        """Under the lock, after a listing: every line there is reflected already."""
        try:
            fd = self._open()
        except OSError:
            self._at = None
            return
        try:
            self._at = (self._ident(fd), self._ends(fd)[0])
        except (OSError, JournalError):
            self._at = None
        finally:
            fsdir.close_read(fd)

    def _ends(self, fd: int) -> tuple[int, int]:
        """(the offset after the last complete line, the offset of the first zero byte:
        where the next line goes). They differ after a writer was killed mid-line."""
        start = self._offset(fd)
        data = self._read_all(fd, start)
        return start + data.rfind(b"\n") + 1, start + len(data)

    def replaced(self) -> bool:
        """Whether another file than the one this store read is under the name now (a
        rewritten snapshot): a store that lost the thread may start again from it (one
        that never read the journal does not: it scanned, and lists)."""
        if self._at is None:
            return False
        try:
            fd = self._open()
        except OSError:
            return False
        try:
            return self._ident(fd) != self._at[0]
        except (OSError, JournalError):
            return False
        finally:
            fsdir.close_read(fd)

    # -- writing (under the lock) -----------------------------------------------------
    def append(self, change: Change) -> bool:
        """Add a change line to the journal there is (none: nothing; the next compaction
        writes one). False if it could not be written or does not fit (readers will find
        the gap; a whole store then writes a new snapshot)."""
        if self.readonly:
            return False
        fd = self._open_or_none(os.O_RDWR, "appended to")
        if fd is None:
            return False
        try:
            st = os.fstat(fd)
            ident = self._ident(fd)
            complete, end = self._ends(fd)
            line = change_line(change)
            if complete != end:
                line = b"\n" + line  # a killed writer's torn line stays one bad line
            if end + len(line) > st.st_size:
                return False  # full: the snapshot is rewritten
            view, at = memoryview(line), end
            while view:
                done = os.pwrite(fd, view, at)
                view, at = view[done:], at + done
            if self._at is not None and self._at == (ident, complete):
                self._at = (ident, end + len(line))  # read our own line already
                self.lines += 1
            return True
        except (OSError, JournalError) as exc:
            log.warning("kvdisk: journal not appended to: %s", exc)
            return False
        finally:
            os.close(fd)

    def compact(self, count: int, entries: Iterable[Entry]) -> bool:
        """Write a new journal whose snapshot is ``entries`` at ``count`` (the caller's
        index, whole at the lock's count), atomically; this store has read it all."""
        if self.readonly:
            return False
        rows = [
            json.dumps(entry_row(e), separators=(",", ":")).encode() + b"\n"
            for e in entries
            if not e.pending
        ]
        body = b"".join(rows)
        header = b""
        gen = secrets.token_hex(8)
        try:
            root = os.fstat(self.root_fd).st_ino
        except OSError as exc:
            log.warning("kvdisk: journal not rewritten: %s", exc)
            return False
        for _ in range(3):  # the offset is written in the header that precedes it
            obj = {
                "kvdisk_journal": VERSION,
                "fields": list(FIELDS),
                "count": count,
                "entries": len(rows),
                "changes_at": len(header) + len(body),
                "id": gen,
                "root": root,
            }
            header = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
        size = len(header) + len(body)
        try:
            with fsdir.TempFile(self.root_fd, NAME) as tmp:
                # Room for change lines after the snapshot, as zeros (sparse where the
                # file system can): appends never change the file's size.
                os.ftruncate(tmp.fd, max(MIN_ROOM, 2 * size))
                tmp.write([header, body])
                inode = tmp.stat().st_ino
                tmp.commit()
        except OSError as exc:
            log.warning("kvdisk: journal not rewritten: %s", exc)
            return False
        self._at = ((inode, gen), len(header) + len(body))
        self.lines = 0
        return True
