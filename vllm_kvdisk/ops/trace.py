"""The decision trace (``--trace FILE``): one human-readable line per decision.

    2026-12-01T10:00:00 KV cache: miss for sha1=abc123... (reason: no checkpoint)
    2026-12-01T10:00:01 KV cache: hit for sha1=def456... (restoring 10112 tokens from 3 ...)
    2026-12-01T10:00:01 KV cache: saved reason=cold sha1=... tokens=10208 bytes=... ms=42

This module owns the format: the connector writes through the typed methods of
:class:`Trace`, and :func:`parse` reads a line back into a :class:`TraceEvent` (tests,
benchmarks and operators' scripts use it; nothing else splits trace strings).

Lines are appended with one ``write`` on an ``O_APPEND`` descriptor, so the scheduler and
the worker processes can share one file without interleaving inside a line. The file is
bounded: past ``max_bytes`` it is renamed to ``FILE.1`` (replacing the previous one) and
started again; a file moved away by logrotate is noticed within a second and reopened.
Only a regular file is ever opened, never blocking (``fsdir.open_regular``): a FIFO or a
device at the trace path is refused with a warning, and start-up goes on without a trace.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.storage import fsdir

log = get_logger(__name__)

PREFIX = "KV cache: "
DEFAULT_MAX_BYTES = 64 << 20
CHECK_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One parsed trace line. ``kind``: miss, hit, loaded, device_hit, probe, saved,
    save_failed, save_skipped, evicted, quarantined, dropped, load_failed, replay,
    object_fetch."""

    kind: str
    sha1: str = ""
    reason: str = ""  # save reason (cold, ...) or the miss/skip reason
    tokens: int = 0
    bytes: int = 0
    files: int = 0
    ms: float = 0.0
    detail: str = ""
    line: str = ""
    request: str = ""  # the request a lookup line is about (miss, hit, device_hit)


_SHA = r"sha1=(?P<sha1>[0-9a-f]{40}|-)"
_REQUEST = re.compile(r"(?:^|; )request=(?P<request>[A-Za-z0-9._:-]+)$")
_REQUEST_CHARS = re.compile(r"[^A-Za-z0-9._:-]")


def _request_tag(request: str) -> str:
    """``; request=ID``: a request id as the trace writes it (vLLM's ids may come from a
    client's header; anything but ``[A-Za-z0-9._:-]`` becomes ``_``, at most 128)."""
    return f"; request={_REQUEST_CHARS.sub('_', request[:128])}" if request else ""


_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("load_failed", re.compile(rf"^miss for {_SHA} \(reason: load failed: (?P<detail>.*)\)$")),
    ("miss", re.compile(rf"^miss for {_SHA} \(reason: (?P<detail>.*)\)$")),
    (
        "loaded",
        re.compile(
            rf"^hit for {_SHA} \(loaded (?P<tokens>\d+) tokens from "
            rf"(?P<files>\d+) file\(s\), (?P<ms>[\d.]+) ms\)$"
        ),
    ),
    (
        "hit",
        re.compile(
            rf"^hit for {_SHA} \(restoring (?P<tokens>\d+) tokens from "
            rf"(?P<files>\d+) file\(s\)(?P<detail>.*)\)$"
        ),
    ),
    ("device_hit", re.compile(rf"^device hit for {_SHA} \((?P<detail>.*)\)$")),
    ("probe", re.compile(rf"^probe for {_SHA} \((?P<detail>.*)\)$")),
    (
        "saved",
        re.compile(
            rf"^saved reason=(?P<reason>\w+) {_SHA} tokens=(?P<tokens>\d+) "
            rf"bytes=(?P<bytes>\d+) ms=(?P<ms>[\d.]+)$"
        ),
    ),
    (
        "save_skipped",
        re.compile(
            rf"^save skipped reason=\w+ {_SHA} why=(?P<reason>\w+): "
            rf"(?P<detail>.*)$"
        ),
    ),
    ("save_failed", re.compile(rf"^save failed reason=(?P<reason>\w+) {_SHA}: (?P<detail>.*)$")),
    ("evicted", re.compile(rf"^evicted {_SHA} tokens=(?P<tokens>\d+) bytes=(?P<bytes>\d+)$")),
    ("quarantined", re.compile(rf"^quarantined {_SHA} \((?P<detail>.*)\)$")),
    (
        "dropped",
        re.compile(
            rf"^dropped {_SHA} tokens=(?P<tokens>\d+) bytes=(?P<bytes>\d+) \((?P<detail>.*)\)$"
        ),
    ),
    ("replay", re.compile(r"^tool replay: (?P<detail>.*)$")),
    (
        "object_fetch",
        re.compile(
            r"^object store fetch \((?P<files>\d+) file\(s\), (?P<bytes>\d+) bytes, "
            r"(?P<ms>[\d.]+) ms(?:; stopped short: (?P<detail>.*))?\)$"
        ),
    ),
]


def parse(line: str) -> TraceEvent | None:
    """The event a trace line records, or None for anything else."""
    at = line.find(PREFIX)
    if at < 0:
        return None
    body = line[at + len(PREFIX) :].rstrip("\n")
    for kind, pattern in _PATTERNS:
        m = pattern.match(body)
        if m is None:
            continue
        g: dict[str, Any] = m.groupdict()
        detail, request = (g.get("detail") or "").lstrip("; "), ""
        tagged = _REQUEST.search(detail)
        if tagged is not None:
            detail, request = detail[: tagged.start()], tagged.group("request")
        return TraceEvent(
            kind,
            g.get("sha1") or "",
            g.get("reason") or "",
            int(g.get("tokens") or 0),
            int(g.get("bytes") or 0),
            int(g.get("files") or 0),
            float(g.get("ms") or 0),
            detail,
            line.rstrip("\n"),
            request,
        )
    return None


def read(path: str, kinds: Iterable[str] | None = None) -> list[TraceEvent]:
    """Every event of a trace file (and of its rotated ``.1`` before it), optionally only
    of the given kinds."""
    wanted = set(kinds) if kinds is not None else None
    out: list[TraceEvent] = []
    for name in (path + ".1", path):
        try:
            fd = fsdir.open_regular(name)
        except FileNotFoundError:
            continue
        except OSError as exc:  # a FIFO or a device would block or never end
            log.warning("kvdisk: cannot read trace %s: %s", name, exc)
            continue
        with open(fd, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                event = parse(line)
                if event is not None and (wanted is None or event.kind in wanted):
                    out.append(event)
    return out


class Trace:
    def __init__(
        self, path: str | None, *, max_bytes: int = DEFAULT_MAX_BYTES, to_log: bool = False
    ):
        self.path = os.path.abspath(path) if path else None
        self.max_bytes = max_bytes
        self.to_log = to_log
        self._fd: int | None = None
        self._checked = 0.0
        if self.path:
            fsdir.make_dirs(os.path.dirname(self.path))
            self._open()

    @classmethod
    def from_config(cls, config: Any) -> Trace:
        return cls(
            config.trace, max_bytes=config.trace_max_mb * 1024 * 1024, to_log=config.trace_to_log
        )

    @property
    def enabled(self) -> bool:
        return self._fd is not None or self.to_log

    def _open(self) -> None:
        if self.path is None:
            return
        try:
            self._fd = fsdir.open_regular(self.path, flags=os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as exc:
            log.warning("kvdisk: cannot open trace %s: %s", self.path, exc)
            self._fd = None

    def _maybe_rotate(self) -> None:
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY_S or self.path is None:
            return
        self._checked = now
        st: os.stat_result | None
        mine: os.stat_result | None
        try:
            st = os.stat(self.path, follow_symlinks=False)
            mine = os.fstat(self._fd) if self._fd is not None else None
        except FileNotFoundError:
            st = mine = None
        except OSError:
            return
        if st is not None and mine is not None and st.st_ino == mine.st_ino:
            if st.st_size < self.max_bytes:
                return
            try:  # another process may rotate at the same moment: either rename wins
                os.replace(self.path, self.path + ".1")
            except OSError:
                return
        if self._fd is not None:
            os.close(self._fd)
        self._open()

    def line(self, message: str) -> None:
        text = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {PREFIX}{message}"
        if self.to_log:
            log.info("%s", text)
        else:
            log.debug("%s", text)
        if self.path is None:
            return
        self._maybe_rotate()
        if self._fd is not None:
            try:
                os.write(self._fd, (text + "\n").encode())
            except OSError as exc:
                log.warning("kvdisk: trace write failed: %s", exc)

    # -- typed events -------------------------------------------------------------------
    def miss(self, sha1: str | None, detail: str, request: str = "") -> None:
        self.line(f"miss for sha1={sha1 or '-'} (reason: {detail}{_request_tag(request)})")

    def hit(self, sha1: str, tokens: int, files: int, detail: str = "", request: str = "") -> None:
        self.line(
            f"hit for sha1={sha1} (restoring {tokens} tokens from {files} file(s)"
            f"{'; ' + detail if detail else ''}{_request_tag(request)})"
        )

    def loaded(self, sha1: str, tokens: int, files: int, seconds: float) -> None:
        self.line(
            f"hit for sha1={sha1} (loaded {tokens} tokens from {files} file(s), "
            f"{seconds * 1e3:.1f} ms)"
        )

    def device_hit(self, sha1: str, on_device: int, on_disk: int, request: str = "") -> None:
        self.line(
            f"device hit for sha1={sha1} ({on_device} tokens in the GPU prefix cache "
            f"cover the {on_disk} on disk{_request_tag(request)})"
        )

    def probe(self, sha1: str, load_s: float, recompute_s: float) -> None:
        self.line(
            f"probe for sha1={sha1} (loading although recompute looked cheaper: est. "
            f"load {load_s * 1e3:.0f} ms vs recompute {recompute_s * 1e3:.0f} ms; "
            "re-measuring the store)"
        )

    def saved(self, reason: str, sha1: str, tokens: int, nbytes: int, seconds: float) -> None:
        self.line(
            f"saved reason={reason} sha1={sha1} tokens={tokens} bytes={nbytes} "
            f"ms={seconds * 1e3:.0f}"
        )

    def save_failed(self, reason: str, sha1: str, detail: str, skipped: str | None = None) -> None:
        if skipped:
            self.line(f"save skipped reason={reason} sha1={sha1} why={skipped}: {detail}")
        else:
            self.line(f"save failed reason={reason} sha1={sha1}: {detail}")

    def evicted(self, sha1: str, tokens: int, nbytes: int) -> None:
        self.line(f"evicted sha1={sha1} tokens={tokens} bytes={nbytes}")

    def quarantined(self, sha1: str, detail: str) -> None:
        self.line(f"quarantined sha1={sha1} ({detail})")

    def dropped(self, sha1: str, tokens: int, nbytes: int, detail: str) -> None:
        """A file deleted because its chain broke (an ancestor was quarantined)."""
        self.line(f"dropped sha1={sha1} tokens={tokens} bytes={nbytes} ({detail})")

    def load_failed(self, sha1: str, detail: str, blocks: int) -> None:
        self.line(
            f"miss for sha1={sha1} (reason: load failed: {detail}; {blocks} block(s) "
            "will be recomputed)"
        )

    def object_fetch(self, files: int, nbytes: int, seconds: float, why: str) -> None:
        self.line(
            f"object store fetch ({files} file(s), {nbytes} bytes, {seconds * 1e3:.0f} ms"
            f"{'; stopped short: ' + why if why else ''})"
        )

    def replay(self, summary: str) -> None:
        self.line(f"tool replay: {summary}")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
