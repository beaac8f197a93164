"""What a request's ``kv_transfer_params`` may ask of the disk cache, parsed with bounds.

Clients control these values, so everything is checked and bounded before use; a bad
value is ignored (and logged once), never an error inside the engine step::

    "kv_transfer_params": {"kvdisk": {"load": false, "save": false, "max_save_tokens": 4096}}

* ``load`` (default true): false skips restoring from disk for this request.
* ``save`` (default true): false writes no checkpoint of this request.
* ``max_save_tokens``: no checkpoint of this request beyond this many tokens.

``kvdisk_tool_map`` (set by the tool-call replay plugin, ``[[id, exact text], ...]``) is
read here too: at most :data:`MAX_TOOL_PAIRS` pairs of at most :data:`MAX_TOOL_BYTES` in
all, each kept only if the checkpoint's text contains it. Pure: no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvdisk.format import MAX_TOOL_ID_BYTES, MAX_TOOL_TEXT_BYTES
from vllm_kvdisk.logs import get_logger

log = get_logger(__name__)

CONTROL_KEY = "kvdisk"
MAP_KEY = "kvdisk_tool_map"  # the replay plugin's key
MAX_TOOL_PAIRS = 64
MAX_TOOL_BYTES = 256 << 10
_warned: set[str] = set()


def _warn_once(what: str) -> None:
    if what not in _warned and len(_warned) < 64:
        _warned.add(what)
        log.warning("kvdisk: ignoring kv_transfer_params %s", what)


def _params(request: Any) -> dict:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


@dataclass(frozen=True, slots=True)
class RequestControl:
    load: bool = True
    save: bool = True
    max_save_tokens: int | None = None

    @classmethod
    def from_request(cls, request: Any) -> RequestControl:
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            # Identity is the token ids: images or embeddings behind placeholder tokens
            # would make two different prompts look alike. Such requests skip the disk.
            return cls(load=False, save=False)
        raw = _params(request).get(CONTROL_KEY)
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            _warn_once(f"{CONTROL_KEY!r}: expected an object")
            return cls()
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if key in ("load", "save") and isinstance(value, bool):
                values[key] = value
            elif (key == "max_save_tokens" and isinstance(value, int)
                  and not isinstance(value, bool) and value >= 0):
                values[key] = value
            else:
                _warn_once(f"{CONTROL_KEY}.{str(key)[:40]}={str(value)[:40]!r}")
        return cls(**values)


def tool_entries(request: Any, text: bytes) -> list[tuple[str, str]]:
    """The (tool-call id, exact text) pairs the request carries whose text the checkpoint
    contains: they go into the file's KTM section (the seed's tool map)."""
    pairs = _params(request).get(MAP_KEY)
    if not isinstance(pairs, list):
        return []
    out, budget = [], MAX_TOOL_BYTES
    for pair in pairs[:MAX_TOOL_PAIRS]:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(isinstance(x, str) for x in pair)):
            continue
        raw_id, raw_text = pair[0].encode(), pair[1].encode()
        if not 0 < len(raw_id) <= MAX_TOOL_ID_BYTES or not 0 < len(raw_text) <= MAX_TOOL_TEXT_BYTES:
            continue
        budget -= len(raw_id) + len(raw_text)
        if budget < 0:
            break
        if raw_text in text:
            out.append((pair[0], pair[1]))
    return out
