"""What a request's ``kv_transfer_params`` may ask of the disk cache, parsed with bounds.

Clients control these values, so everything is checked and bounded before use; a bad
value is ignored (and logged once), never an error inside the engine step::

    "kv_transfer_params": {"kvdisk": {"load": false, "save": false, "max_save_tokens": 4096}}

* ``load`` (default true): false skips restoring from disk for this request.
* ``save`` (default true): false writes no checkpoint of this request.
* ``max_save_tokens``: no checkpoint of this request beyond this many tokens.
* ``pin_s``: keep this request's checkpoints from eviction for this many seconds (1 to
  :data:`MAX_PIN_S`), within the pin share of the budget (``kv_disk_pin_share_pct``).

``kvdisk_tool_map`` (set by the tool-call replay plugin, ``[[id, exact text], ...]``) is
read here too: at most :data:`MAX_TOOL_PAIRS` pairs of at most :data:`MAX_TOOL_BYTES` in
all, each kept only if the checkpoint's text contains it. Every ``kvdisk_*`` key is
internal: the API server removes it from what a client sends (:func:`without_internal`,
applied by the replay plugin to every request before it reaches the engine), so a map
here is always the server's own.

Invariant: :meth:`RequestControl.from_request` is the only reader of client values and
never raises; everything it keeps is usable as is (strings that encode to UTF-8 within
the KTM limits, ints within bounds). Nothing client-supplied is parsed later, so no
client value can fail a step after a save was reserved. Pure: no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.core.toolmap import MAX_TOOL_ID_BYTES, MAX_TOOL_TEXT_BYTES

log = get_logger(__name__)

CONTROL_KEY = "kvdisk"
MAP_KEY = "kvdisk_tool_map"  # the replay plugin's key
INTERNAL_PREFIX = "kvdisk_"  # keys the server writes for itself; never a client's
MAX_TOOL_PAIRS = 64
MAX_TOOL_BYTES = 256 << 10
MAX_SAVE_TOKENS = 1 << 40  # more than any context: a larger cap is no cap
MAX_PIN_S = 7 * 86400
_warned: set[str] = set()


def _warn_once(what: str) -> None:
    if what not in _warned and len(_warned) < 64:
        _warned.add(what)
        log.warning("kvdisk: ignoring kv_transfer_params %s", what)


def _brief(value: Any) -> str:
    """A short, printable description of a client value. Never raises: no ``str()`` of
    containers (deep nesting), of huge ints (over Python's digit limit), no raw surrogates."""
    if isinstance(value, str):
        return ascii(value[:40])
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else "a huge integer"
    if isinstance(value, float):
        return repr(value)
    return f"a {type(value).__name__}"


def is_internal(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(INTERNAL_PREFIX)


def without_internal(params: Any) -> Any:
    """``kv_transfer_params`` as a client may send them: without the internal keys (a new
    dict when there were any; anything that is not a dict is returned as is)."""
    if not isinstance(params, dict) or not any(is_internal(k) for k in params):
        return params
    return {k: v for k, v in params.items() if not is_internal(k)}


def _params(request: Any) -> dict[str, Any]:
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else {}


@dataclass(frozen=True, slots=True)
class ToolPair:
    """One (tool-call id, exact text) pair, checked: both encode to UTF-8 within limits."""

    id: str
    text: str
    raw_text: bytes


@dataclass(frozen=True, slots=True)
class RequestControl:
    load: bool = True
    save: bool = True
    max_save_tokens: int | None = None
    pin_s: int = 0  # keep the request's checkpoints this long (0: no pin)
    tool_pairs: tuple[ToolPair, ...] = ()

    @classmethod
    def from_request(cls, request: Any) -> RequestControl:
        if (
            getattr(request, "mm_features", None)
            or getattr(request, "prompt_embeds", None) is not None
        ):
            # Identity is the token ids: images or embeddings behind placeholder tokens
            # would make two different prompts look alike. Such requests skip the disk.
            return cls(load=False, save=False)
        try:
            params = _params(request)
            values = _control_values(params.get(CONTROL_KEY))
            return cls(**values, tool_pairs=_tool_pairs(params.get(MAP_KEY)))
        except Exception as exc:  # noqa: BLE001 - a client value must never fail a step
            # Unreachable by design (every value is checked by type first); should a
            # client find a way, its request goes without the disk, the engine serves on.
            _warn_once(f"(unreadable: {type(exc).__name__})")
            return cls(load=False, save=False)


def _control_values(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        _warn_once(f"{CONTROL_KEY!r}: expected an object")
        return {}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("load", "save") and isinstance(value, bool):
            values[key] = value
        elif (
            key == "max_save_tokens"
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value >= 0
        ):
            values[key] = value if value <= MAX_SAVE_TOKENS else None
        elif (
            key == "pin_s"
            and isinstance(value, int)
            and not isinstance(value, bool)
            and 0 < value <= MAX_PIN_S
        ):
            values[key] = value
        else:
            _warn_once(f"{CONTROL_KEY}.{_brief(key)}={_brief(value)}")
    return values


def _utf8(value: str) -> bytes | None:
    try:
        return value.encode()
    except UnicodeEncodeError:  # a lone surrogate: valid JSON, not text
        return None


def _tool_pairs(pairs: Any) -> tuple[ToolPair, ...]:
    if pairs is None:
        return ()
    if not isinstance(pairs, list):
        _warn_once(f"{MAP_KEY}: expected a list")
        return ()
    out, budget = [], MAX_TOOL_BYTES
    for pair in pairs[:MAX_TOOL_PAIRS]:
        if not (
            isinstance(pair, (list, tuple))
            and len(pair) == 2
            and all(isinstance(x, str) for x in pair)
        ):
            continue
        raw_id, raw_text = _utf8(pair[0]), _utf8(pair[1])
        if raw_id is None or raw_text is None:
            _warn_once(f"{MAP_KEY}: a pair that is not UTF-8")
            continue
        if not 0 < len(raw_id) <= MAX_TOOL_ID_BYTES or not 0 < len(raw_text) <= MAX_TOOL_TEXT_BYTES:
            continue
        budget -= len(raw_id) + len(raw_text)
        if budget < 0:
            break
        out.append(ToolPair(pair[0], pair[1], raw_text))
    return tuple(out)


def tool_entries(control: RequestControl, text: bytes) -> list[tuple[str, str]]:
    """The (tool-call id, exact text) pairs the request carries whose text the checkpoint
    contains: they go into the file's KTM section (the seed's tool map)."""
    return [(p.id, p.text) for p in control.tool_pairs if p.raw_text in text]
