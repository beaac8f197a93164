"""``ROOT/.pins``: checkpoints a request asked to keep (``kv_transfer_params.kvdisk.pin_s``)
until a time, shared by every process of the directory.

One JSON object, ``{"version": 1, "share": BYTES, "pins": [[namespace, sha1, until],
...]}`` (``until``: epoch seconds; ``share``: the bytes pins may keep, as the server that
wrote the file was configured, so every process and ``kvdisk gc`` honour the same pins),
replaced whole (temp file, fsync, rename) by the process that adds pins,
under ``ROOT/.lock``; read by whoever plans an eviction, under the same lock, again only
when its (inode, size, mtime) changed. Expired pins are dropped at each write; at most
:data:`MAX_PINS` are kept (the latest ``until`` first).

Invariants:
* A pin protects a file from eviction only while it has not expired, and only within the
  pin share of the budget: the pins that end latest are honoured first, while their
  files' bytes fit the share (:func:`honoured`). A leaf that is kept keeps its ancestors
  (eviction removes leaves only).
* Whatever the file holds (truncated, hostile, another version) reads as no pins: it can
  make files evictable, never make anything raise.

Standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping

from vllm_kvdisk.core.entry import Entry, Key
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir

log = get_logger(__name__)

NAME = ".pins"
VERSION = 1
MAX_PINS = 65536
MAX_BYTES = 16 << 20


def parse(raw: bytes) -> tuple[dict[Key, float], int]:
    """The pins a file's bytes say and their share; none for anything that is not a pin
    file of ours."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return {}, 0
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        return {}, 0
    share = doc.get("share")
    if not isinstance(share, int) or isinstance(share, bool) or share < 0:
        return {}, 0
    rows = doc.get("pins")
    out: dict[Key, float] = {}
    for row in rows[:MAX_PINS] if isinstance(rows, list) else ():
        if (
            isinstance(row, list)
            and len(row) == 3
            and isinstance(row[0], str)
            and isinstance(row[1], str)
            and isinstance(row[2], (int, float))
            and not isinstance(row[2], bool)
        ):
            out[(row[0], row[1])] = float(row[2])
    return out, share


def encode(pins: Mapping[Key, float], share: int, now: float) -> bytes:
    live = sorted(
        ((until, ns, sha1) for (ns, sha1), until in pins.items() if until > now), reverse=True
    )[:MAX_PINS]
    rows = [[ns, sha1, round(until, 3)] for until, ns, sha1 in live]
    doc = {"version": VERSION, "share": share, "pins": rows}
    return json.dumps(doc, separators=(",", ":")).encode()


def honoured(
    pins: Mapping[Key, float], entries: Mapping[Key, Entry], share: int, now: float
) -> set[Key]:
    """The keys of live pins kept from eviction: latest ``until`` first, while the pinned
    files' bytes fit ``share``."""
    kept: set[Key] = set()
    used = 0
    for key, until in sorted(pins.items(), key=lambda kv: kv[1], reverse=True):
        entry = entries.get(key)
        if until <= now or entry is None:
            continue
        if used + entry.size > share:
            continue
        used += entry.size
        kept.add(key)
    return kept


class PinFile:
    """``ROOT/.pins`` of one open cache directory (``dir_fd``); the caller holds
    ``ROOT/.lock`` around :meth:`read` and :meth:`add`."""

    def __init__(self, dir_fd: int):
        self.dir_fd = dir_fd
        self._seen: tuple[int, int, int] | None = None
        self._pins: tuple[dict[Key, float], int] = ({}, 0)

    def read(self) -> tuple[dict[Key, float], int]:
        """The pins and their share (bytes)."""
        try:
            st = os.stat(NAME, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            self._seen, self._pins = None, ({}, 0)
            return self._pins
        except OSError as exc:
            log.warning("kvdisk: cannot read %s: %s", NAME, exc)
            return {}, 0
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._seen:
            return self._pins
        try:
            fd = fsdir.open_regular(NAME, dir_fd=self.dir_fd)
            with open(fd, "rb") as fh:
                raw = fh.read(MAX_BYTES + 1)
        except OSError as exc:
            log.warning("kvdisk: cannot read %s: %s", NAME, exc)
            return {}, 0
        self._seen, self._pins = stamp, parse(raw) if len(raw) <= MAX_BYTES else ({}, 0)
        return self._pins

    def kept(self, index_get: Callable[[str, str], Entry | None], now: float) -> set[Key]:
        """The keys eviction must leave now (:func:`honoured`)."""
        pins, share = self.read()
        if not pins or share <= 0:
            return set()
        entries = {k: e for k in pins if (e := index_get(*k)) is not None}
        return honoured(pins, entries, share, now)

    def add(self, pins: Iterable[tuple[Key, float]], share: int, now: float) -> None:
        """Pin these keys until their times (a later time wins over an earlier one); the
        file's share becomes ``share``."""
        merged = dict(self.read()[0])
        for key, until in pins:
            merged[key] = max(until, merged.get(key, 0.0))
        fsdir.write_atomic(self.dir_fd, NAME, [encode(merged, share, now)])
        self._seen = None
