"""The tool-call log (``.ktl``): an append-only, checksummed log every API server shares.

When the server returns a tool call, the pair (tool-call ids -> the exact text and token
ids the model sampled) is appended to this process's log *before* the response leaves, so
a call answered one second before a SIGTERM, or before a kill -9, replays after the
restart. Every API-server process (replicas, ``--api-server-count``) reads all logs at
start-up and tails them.

Layout: ``ROOT/toolmap/<host>-<pid>-<random>.ktl`` (0600), one per writing process, which
holds an exclusive ``flock`` on it while alive. A record::

    magic "KTL2" | u32 body length | u64 xxh3-64 of the body | body
    body: u16 scope length, scope (the model and its tokenizer's identity: records of
          another model are never used) | u16 tenant length, tenant (the replay scope of
          the request: LoRA adapter and cache salt digest, hashed) | 32 bytes prefix digest
          (of the prompt the turn was sampled after) | u32 id count (1..128) | u32 text
          length (<= 1 MiB) | u32 token count (<= 2^18) | per id: u16 length (1..1024), id
          bytes | text (UTF-8) | token ids (u32 each)

All integers little-endian. A record carries its whole scope, so after a restart a call
replays only for the tenant and after the prompt it was returned for. A bad record (wrong
checksum, a length past its limit) is logged once and skipped by searching for the next
magic; a ``KTL1`` record (an earlier version, without tenant or prefix) is skipped
silently: it can never replay. An incomplete last record is a write in progress (or a
crash) and is read again later. Bounded: a writer whose log holds more than ``max_ids`` +
1024 records, or more than ``max_bytes`` + 1/4 of it, rewrites it with the newest records
the replay memory holds (at most ``max_ids`` ids and ``max_bytes``; temp file, fsync,
rename); at start-up, a dead writer's log that holds only the reader's own scope is folded
into the reader's own log and deleted. A log that holds another scope's records (another
model's server shares the directory) is left for that model's servers: folding must never
lose a call another model may still replay. Pure: standard library and xxhash.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir

log = get_logger(__name__)

DIRNAME = "toolmap"
SUFFIX = ".ktl"
MAGIC = b"KTL2"
LEGACY_MAGIC = b"KTL1"  # no tenant, no prefix: skipped, never replayed
PREFIX_BYTES = 32
HEAD = struct.Struct("<4sIQ")
COUNTS = struct.Struct("<III")
MAX_IDS_PER_RECORD = 128
MAX_ID_BYTES = 1024
MAX_TEXT_BYTES = 1 << 20
MAX_TOKENS = 1 << 18
MAX_BODY = 8 << 20
READ_CHUNK = 1 << 20
SLACK_RECORDS = 1024


@dataclass(frozen=True, slots=True)
class ToolCall:
    ids: tuple[str, ...]
    text: str
    token_ids: Sequence[int]
    tenant: str
    prefix: bytes  # PREFIX_BYTES


def encode_record(scope: str, call: ToolCall) -> bytes:
    raw_scope = scope.encode()
    raw_tenant = call.tenant.encode()
    raw_ids = [i.encode() for i in call.ids]
    raw_text = call.text.encode()
    if (
        not 1 <= len(raw_ids) <= MAX_IDS_PER_RECORD
        or len(raw_scope) > 0xFFFF
        or len(raw_tenant) > 0xFFFF
        or len(call.prefix) != PREFIX_BYTES
        or any(not 1 <= len(i) <= MAX_ID_BYTES for i in raw_ids)
        or len(raw_text) > MAX_TEXT_BYTES
        or len(call.token_ids) > MAX_TOKENS
    ):
        raise ValueError("tool call outside the record limits")
    parts = [
        struct.pack("<H", len(raw_scope)),
        raw_scope,
        struct.pack("<H", len(raw_tenant)),
        raw_tenant,
        call.prefix,
        COUNTS.pack(len(raw_ids), len(raw_text), len(call.token_ids)),
    ]
    for raw in raw_ids:
        parts += [struct.pack("<H", len(raw)), raw]
    parts += [raw_text, struct.pack(f"<{len(call.token_ids)}I", *call.token_ids)]
    body = b"".join(parts)
    return HEAD.pack(MAGIC, len(body), xxhash.xxh3_64_intdigest(body)) + body


def decode_body(body: bytes) -> tuple[str, ToolCall]:
    """Raises ValueError for anything malformed."""
    (scope_len,) = struct.unpack_from("<H", body, 0)
    pos = 2 + scope_len
    scope = body[2:pos].decode()
    (tenant_len,) = struct.unpack_from("<H", body, pos)
    tenant = body[pos + 2 : pos + 2 + tenant_len].decode()
    pos += 2 + tenant_len
    prefix = bytes(body[pos : pos + PREFIX_BYTES])
    if len(prefix) != PREFIX_BYTES:
        raise ValueError("record too short for its prefix digest")
    pos += PREFIX_BYTES
    n_ids, text_len, n_tokens = COUNTS.unpack_from(body, pos)
    pos += COUNTS.size
    if not 1 <= n_ids <= MAX_IDS_PER_RECORD or text_len > MAX_TEXT_BYTES or n_tokens > MAX_TOKENS:
        raise ValueError("record counts outside the limits")
    ids = []
    for _ in range(n_ids):
        (id_len,) = struct.unpack_from("<H", body, pos)
        if not 1 <= id_len <= MAX_ID_BYTES:
            raise ValueError("tool id length outside the limits")
        ids.append(body[pos + 2 : pos + 2 + id_len].decode())
        pos += 2 + id_len
    text = body[pos : pos + text_len].decode()
    pos += text_len
    if pos + 4 * n_tokens != len(body):
        raise ValueError("record lengths do not add up")
    tokens = struct.unpack_from(f"<{n_tokens}I", body, pos)
    return scope, ToolCall(tuple(ids), text, tuple(tokens), tenant, prefix)


@dataclass(slots=True)
class Scan:
    """What :func:`scan_records` found: the calls of one scope, the bytes consumed (up to
    the end of the last complete record), damaged records skipped, and how many sound
    records belonged to another scope (counted, never decoded)."""

    calls: list[ToolCall]
    used: int
    bad: int
    foreign: int


def scan_records(buf: bytes | bytearray, scope: str) -> Scan:
    """The records of ``scope`` in ``buf``. An incomplete record at the end is left for a
    later read; bad bytes are skipped by searching for the next magic. Linear in
    ``len(buf)``: bodies are checksummed in place and only this scope's are copied."""
    want = scope.encode()
    prefix = struct.pack("<H", len(want)) + want
    calls: list[ToolCall] = []
    pos = bad = foreign = 0
    with memoryview(buf) as view:
        while pos + HEAD.size <= len(buf):
            magic, length, checksum = HEAD.unpack_from(buf, pos)
            if magic == LEGACY_MAGIC and length <= MAX_BODY:
                # An earlier version's record: whole or not, it never replays (it has no
                # scope); skip its length, or search on if it is damaged.
                end = pos + HEAD.size + length
                if end > len(buf):
                    break
                if xxhash.xxh3_64_intdigest(view[pos + HEAD.size : end]) == checksum:
                    pos = end
                    continue
            if magic != MAGIC or length > MAX_BODY:
                bad += 1
                nxt = buf.find(MAGIC, pos + 1)
                if nxt < 0:
                    return Scan(calls, max(pos, len(buf) - len(MAGIC) + 1), bad, foreign)
                pos = nxt
                continue
            end = pos + HEAD.size + length
            if end > len(buf):
                break  # incomplete: a write in progress or a crash mid-write
            body = view[pos + HEAD.size : end]
            try:
                if xxhash.xxh3_64_intdigest(body) != checksum:
                    raise ValueError("checksum mismatch")
                if body[: len(prefix)] != prefix:
                    foreign += 1  # another model's: sound (checksummed), not ours to decode
                else:
                    calls.append(decode_body(bytes(body))[1])
                pos = end
            except (ValueError, struct.error, UnicodeDecodeError):
                bad += 1
                nxt = buf.find(MAGIC, pos + 1)
                if nxt < 0:
                    return Scan(calls, end, bad, foreign)
                pos = nxt
    return Scan(calls, pos, bad, foreign)


def read_records(fd: int, start: int, size: int, scope: str) -> Scan:
    """The records of ``scope`` in bytes ``[start, size)`` of ``fd``, read through one
    reused window: memory is a window plus at most one record, however long the log (it
    may hold ~100k records before compaction); ``used`` counts from ``start``."""
    window = bytearray(min(READ_CHUNK, max(size - start, 0)))
    pending = bytearray()  # read, not yet consumed: at most one incomplete record
    out = Scan([], 0, 0, 0)
    at = start
    while at < size and window:
        with memoryview(window) as view:
            n = os.preadv(fd, [view[: min(len(window), size - at)]], at)
            if n <= 0:
                break
            pending += view[:n]
        at += n
        found = scan_records(pending, scope)
        out.calls += found.calls
        out.used += found.used
        out.bad += found.bad
        out.foreign += found.foreign
        del pending[: found.used]
    return out


class ToolLog:
    """This process's log plus a reader of everyone's. Thread-safe."""

    def __init__(self, root: str, scope: str, max_ids: int, max_bytes: int | None = None):
        self.scope = scope
        self.max_ids = max_ids
        self.max_bytes = max_bytes
        self._bytes = 0  # this process's log
        self._lock = threading.Lock()
        self._offsets: dict[str, int] = {}  # file -> bytes consumed
        self._foreign: set[str] = set()  # files holding another scope's records
        self._warned: set[str] = set()
        self._fd: int | None = None
        self._name: str | None = None
        self._records = 0
        self._dir_fd: int | None = None
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
            root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self._dir_fd = fsdir.make_dir(DIRNAME, root_fd)
            finally:
                os.close(root_fd)
        except OSError as exc:
            log.warning("kvdisk replay: tool-call log unavailable in %s: %s", root, exc)

    @property
    def available(self) -> bool:
        return self._dir_fd is not None

    # -- writing ------------------------------------------------------------------------
    def _open_own(self) -> None:
        host = "".join(c for c in socket.gethostname() if c.isalnum() or c in "-_")[:40] or "host"
        self._name = f"{host}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
        self._fd = os.open(
            self._name,
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | fsdir.NOFOLLOW,
            0o600,
            dir_fd=self._dir_fd,
        )
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._records = 0
        self._bytes = 0
        self._offsets[self._name] = 0

    def append(self, call: ToolCall, newest: Callable[[], list[ToolCall]] | None = None) -> bool:
        """Make one tool call durable (one ``write`` of the whole record). ``newest``:
        what to keep if the log must be compacted first."""
        if self._dir_fd is None or self.max_ids == 0:
            return False
        try:
            record = encode_record(self.scope, call)
        except ValueError:
            return False
        with self._lock:
            try:
                if self._fd is None:
                    self._open_own()
                elif self._too_big(len(record)) and newest is not None:
                    self._compact(newest())
                fd, name = self._own()
                os.write(fd, record)
                self._records += 1
                self._bytes += len(record)
                self._offsets[name] += len(record)
                return True
            except OSError as exc:
                log.warning("kvdisk replay: could not record a tool call: %s", exc)
                return False

    def _own(self) -> tuple[int, str]:
        """This process's open log (descriptor, name)."""
        if self._fd is None or self._name is None:
            raise OSError("the tool-call log is not open")
        return self._fd, self._name

    def _too_big(self, adding: int) -> bool:
        if self._records >= self.max_ids + SLACK_RECORDS:
            return True
        if self.max_bytes is None:
            return False
        return self._bytes + adding > self.max_bytes + max(self.max_bytes // 4, READ_CHUNK)

    def _compact(self, keep: list[ToolCall]) -> None:
        """Rewrite this process's log with only ``keep`` (the newest calls)."""
        old_fd, old_name = self._fd, self._name
        body = b"".join(encode_record(self.scope, c) for c in keep[-self.max_ids :])
        self._open_own()
        fd, name = self._own()
        os.write(fd, body)
        os.fsync(fd)
        self._records = min(len(keep), self.max_ids)
        self._bytes = len(body)
        self._offsets[name] = len(body)
        if old_fd is not None:
            os.close(old_fd)
        if old_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(old_name, dir_fd=self._dir_fd)
            self._offsets.pop(old_name, None)

    # -- reading ------------------------------------------------------------------------
    def poll(self) -> list[ToolCall]:
        """Calls appended by any process since the last poll, oldest first within a file.
        Never raises: unreadable files and bad bytes are logged and skipped."""
        if self._dir_fd is None:
            return []
        out: list[ToolCall] = []
        try:
            with os.scandir(self._dir_fd) as it:
                names = sorted(
                    de.name
                    for de in it
                    if de.name.endswith(SUFFIX) and de.is_file(follow_symlinks=False)
                )
        except OSError as exc:
            log.warning("kvdisk replay: cannot list the tool-call logs: %s", exc)
            return []
        for name in names:
            if name == self._name:
                continue
            out += self._read_new(name)
        for gone in set(self._offsets) - set(names) - {self._name}:
            del self._offsets[gone]
            self._foreign.discard(gone)
        return out

    def _read_new(self, name: str) -> list[ToolCall]:
        start = self._offsets.get(name, 0)
        scanned = self._scan_file(name, start)
        if scanned is None:
            return []
        start, found = scanned
        if found.bad:
            self._warn(name, f"{found.bad} damaged record(s) skipped")
        self._offsets[name] = start + found.used
        if found.foreign:
            self._foreign.add(name)
        return found.calls

    def _scan_file(self, name: str, start: int) -> tuple[int, Scan] | None:
        """(where reading started, what was found) in ``name`` past ``start`` (from 0 if
        the file shrank: its writer rewrote it); None if it is not a readable regular
        file. Never blocks: a FIFO or a device named like a log is opened non-blocking
        and refused."""
        try:
            fd = fsdir.open_regular(name, self._dir_fd)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                self._warn(name, f"cannot open: {exc}")
            return None
        try:
            st = os.fstat(fd)
            if st.st_size < start:  # rewritten by its writer: read it again from the start
                start = 0
            return start, read_records(fd, start, st.st_size, self.scope)
        except OSError as exc:
            self._warn(name, f"cannot read: {exc}")
            return None
        finally:
            os.close(fd)

    def _warn(self, name: str, what: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning("kvdisk replay: tool-call log %s: %s", name, what)

    def fold_dead(self, newest: list[ToolCall]) -> int:
        """Delete the logs whose writer is gone and whose every record ``poll`` has read and
        found in this scope, after writing ``newest`` to this process's own log. Returns
        the logs deleted. A log with another scope's records is never touched here."""
        if self._dir_fd is None:
            return 0
        dead = []
        with os.scandir(self._dir_fd) as it:
            for de in it:
                if (
                    de.name.endswith(SUFFIX)
                    and de.name != self._name
                    and de.name not in self._foreign
                    and de.is_file(follow_symlinks=False)
                    and self._read_whole(de.name)
                    and fsdir.writer_gone(self._dir_fd, de.name)
                ):
                    dead.append(de.name)
        if not dead:
            return 0
        with self._lock:
            try:
                if self._fd is None:
                    self._open_own()
                self._compact(newest)
            except OSError as exc:
                log.warning("kvdisk replay: could not fold old tool-call logs: %s", exc)
                return 0
        for name in dead:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._dir_fd)
            self._offsets.pop(name, None)
        return len(dead)

    def _read_whole(self, name: str) -> bool:
        """Whether ``poll`` has read every complete record of ``name``: a log that appeared
        since, or grew, may hold records nobody has read. A torn last record (its writer
        died mid-write) is no record."""
        start = self._offsets.get(name)
        if start is None:
            return False
        scanned = self._scan_file(name, start)
        return (
            scanned is not None
            and scanned[0] == start
            and not scanned[1].calls
            and not scanned[1].foreign
        )

    def close(self) -> None:
        with self._lock:
            for fd in (self._fd, self._dir_fd):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._fd = self._dir_fd = None


def newest_calls(calls: list[ToolCall], limit: int) -> list[ToolCall]:
    """The newest ``limit`` distinct calls (by id), oldest first."""
    by_id: OrderedDict[str, ToolCall] = OrderedDict()
    for call in calls:
        for tid in call.ids:
            by_id.pop(tid, None)
            by_id[tid] = call
    seen: list[ToolCall] = []
    marks: set[int] = set()
    for call in reversed(by_id.values()):
        if id(call) not in marks:
            marks.add(id(call))
            seen.append(call)
        if len(seen) >= limit:
            break
    return list(reversed(seen))
