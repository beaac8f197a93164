"""What the disk cache did for one request, as its response tells the client.

The scheduler connector returns ``{"kvdisk": CacheReport.to_dict()}`` from
``request_finished``; vLLM hands a connector's params to the response as
``kv_transfer_params`` (the API server plugin adds them to a stream's final chunk, and the
message a divergence falls in: :mod:`vllm_kvdisk.api.report`). The fields, their names and
types are documented in README ("Is my prompt cached?"); :data:`VERSION` changes when a
field changes meaning.

Invariants:
* Only what the request's own scope may know: counts, checkpoint names (sha1) and offsets
  in the request's own prompt, compared only with checkpoints of its own namespace (cache
  salt, LoRA adapter, model). Text of a checkpoint appears only as a bounded excerpt, and
  only when the operator turned excerpts on (``kv_diagnose_excerpt_bytes``).
* A field that needs file reads (``divergence``) is filled by the diagnostics thread; the
  response carries it if it was ready when the request finished, else only the trace does.

Pure: standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_kvdisk.core.index import Miss

REPORT_KEY = "kvdisk"  # the same key a client's controls use in its kv_transfer_params
VERSION = 1
MAX_EXCERPT_BYTES = 1024


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where the prompt leaves its nearest checkpoint: the first byte and token of the
    prompt that differ from the checkpoint's, and optionally excerpts of both sides
    around that byte (UTF-8, undecodable bytes replaced)."""

    reason: Miss  # PREFIX_MISMATCH, or TOKENS_DIFFER (same text, other tokens)
    checkpoint: str
    token: int
    byte: int
    ours: str | None = None
    theirs: str | None = None

    def words(self) -> str:
        """The trace's words for it."""
        if self.reason is Miss.TOKENS_DIFFER:
            return f"{self.reason.value} at token {self.token} of checkpoint {self.checkpoint}"
        return (
            f"{self.reason.value} at byte {self.byte} (token {self.token}) of "
            f"checkpoint {self.checkpoint}"
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "reason": self.reason.label,
            "checkpoint": self.checkpoint,
            "token": self.token,
            "byte": self.byte,
        }
        if self.ours is not None and self.theirs is not None:
            out["excerpt"] = {"prompt": self.ours, "checkpoint": self.theirs}
        return out


def excerpt(text: bytes, at: int, size: int) -> str:
    """At most ``size`` bytes of ``text`` around byte ``at`` (half before it), as text."""
    size = max(0, min(size, MAX_EXCERPT_BYTES))
    start = max(0, at - size // 2)
    return text[start : start + size].decode("utf-8", errors="replace")


@dataclass(slots=True)
class CacheReport:
    """One request's prompt, by where its KV came from. ``device_tokens``: vLLM's own
        prefix cache held them; ``disk_tokens``: loaded from checkpoint ``checkpoint`` (the
        deepest file of the chain); the rest was computed. ``reason``: why the disk had
        nothing deeper (the metric's label), None when the prompt went as deep as a lookup
        can (every whole block but the one holding the last token). ``saves``: the checkpoints
    planned from it (written after the response, asynchronously; one already on disk is not
    written again)."""

    prompt_tokens: int
    device_tokens: int = 0
    disk_tokens: int = 0
    checkpoint: str | None = None
    reason: Miss | None = None
    divergence: Divergence | None = None  # set by the diagnostics thread, if ever
    load_failed: bool = False
    saves: list[str] = field(default_factory=list)  # checkpoints planned for it (sha1)
    pin: dict[str, Any] | None = None  # {"seconds": N}, or {"refused": why}

    @property
    def computed_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.device_tokens - self.disk_tokens)

    def to_dict(self) -> dict[str, Any]:
        divergence = self.divergence  # read once: another thread may set it meanwhile
        return {
            "version": VERSION,
            "prompt_tokens": self.prompt_tokens,
            "device_tokens": self.device_tokens,
            "disk_tokens": self.disk_tokens,
            "computed_tokens": self.computed_tokens,
            "checkpoint": self.checkpoint,
            "reason": self.reason.label if self.reason is not None else None,
            "divergence": divergence.to_dict() if divergence is not None else None,
            "load_failed": self.load_failed,
            "saves": list(self.saves),
            "pin": self.pin,
        }
