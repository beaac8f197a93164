"""``kvdisk why``: where one prompt leaves another, for an operator, in the words of the
trace and of each response's ``kvdisk.divergence``.

Two ways in:

* two prompts, each a file: a chat request body (JSON with ``messages``, optionally
  ``tools``), a completions body (JSON with a string ``prompt``), or plain text. Two chat
  bodies are compared message by message in the order templates usually render them (a
  system message, then the tool definitions, then the other messages): the first one
  that differs, its role, and what changed (text, role, tool calls; arguments that are the
  same JSON written with other key order or spacing are named as such, the template
  renders them as sent). Anything else is compared as text: the first byte that differs.
* a request id and the trace file: the lookup lines the connector wrote for that request
  (``request=ID``), with their reasons.

Without the model's tokenizer and template no token offset can be given here; the
response's ``kvdisk`` object has it. Pure: standard library.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from vllm_kvdisk.ops.trace import TraceEvent, read

LOOKUP_KINDS = ("miss", "hit", "device_hit")  # the lines that name their request


@dataclass(slots=True)
class Why:
    """Where prompt B leaves prompt A (None: they are the same)."""

    what: str  # system, tools, message, role, tool_calls, arguments_reserialised, text, ...
    words: str
    index: int | None = None  # the message index (chat)
    role: str | None = None
    offset: int | None = None  # character of the content (chat) or byte (text)
    excerpts: tuple[str, str] = ("", "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": "prefix_mismatch",
            "what": self.what,
            "message": (
                None
                if self.index is None and self.role is None
                else {"index": self.index, "role": self.role}
            ),
            "offset": self.offset,
            "words": self.words,
            "excerpt": {"a": self.excerpts[0], "b": self.excerpts[1]},
        }


@dataclass(slots=True)
class Prompt:
    messages: list[Any] | None = None
    tools: Any = None
    text: bytes = b""
    raw: dict[str, Any] = field(default_factory=dict)


def load_prompt(path: str) -> Prompt:
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return Prompt(text=data)
    if isinstance(body, dict) and isinstance(body.get("messages"), list):
        return Prompt(body["messages"], body.get("tools"), raw=body)
    if isinstance(body, dict) and isinstance(body.get("prompt"), str):
        return Prompt(text=body["prompt"].encode())
    return Prompt(text=data)


def _around(text: str, at: int, width: int) -> str:
    start = max(0, at - width // 2)
    return text[start : start + width]


def _first_difference(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def compare_text(a: bytes, b: bytes, width: int = 80) -> Why | None:
    if a == b:
        return None
    at = _first_difference(a.decode("latin-1"), b.decode("latin-1"))  # bytewise
    line = a[:at].count(b"\n") + 1
    column = at - (a.rfind(b"\n", 0, at) + 1)
    excerpts = (
        _around(a.decode("utf-8", "replace"), len(a[:at].decode("utf-8", "replace")), width),
        _around(b.decode("utf-8", "replace"), len(b[:at].decode("utf-8", "replace")), width),
    )
    return Why(
        "text",
        f"prefix mismatch at byte {at} (line {line}, column {column})",
        offset=at,
        excerpts=excerpts,
    )


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else None


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return json.dumps(content, ensure_ascii=False)


def _canonical(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _message_why(i: int, a: Any, b: Any, width: int) -> Why:
    role = _get(b, "role") if isinstance(_get(b, "role"), str) else None
    if _get(a, "role") != _get(b, "role"):
        return Why("role", f"message {i} changed role ({_get(a, 'role')} -> {role})", i, role)
    ta, tb = _text_of(_get(a, "content")), _text_of(_get(b, "content"))
    if ta != tb:
        at = _first_difference(ta, tb)
        what = "system" if role == "system" else "message"
        return Why(
            what,
            f"prefix mismatch in message {i} ({role}) at character {at} of its content",
            i,
            role,
            at,
            (_around(ta, at, width), _around(tb, at, width)),
        )
    calls_a, calls_b = _get(a, "tool_calls") or [], _get(b, "tool_calls") or []
    if isinstance(calls_a, list) and isinstance(calls_b, list) and len(calls_a) == len(calls_b):
        for k, (ca, cb) in enumerate(zip(calls_a, calls_b)):
            fa, fb = _get(ca, "function") or {}, _get(cb, "function") or {}
            args_a, args_b = _get(fa, "arguments"), _get(fb, "arguments")
            if (
                _get(fa, "name") == _get(fb, "name")
                and args_a != args_b
                and _canonical(args_a) == _canonical(args_b)
            ):
                return Why(
                    "arguments_reserialised",
                    f"prefix mismatch in message {i} ({role}): tool call {k}'s arguments are "
                    "the same JSON with other key order or spacing (rendered as sent: "
                    "serialise them canonically, e.g. sorted keys)",
                    i,
                    role,
                    None,
                    (str(args_a), str(args_b)),
                )
    return Why("message", f"prefix mismatch in message {i} ({role}): other fields differ", i, role)


def compare_chat(a: Prompt, b: Prompt, width: int = 80) -> Why | None:
    ma, mb = a.messages or [], b.messages or []
    order: list[tuple[str, int]] = []
    start = 0
    if (ma and _get(ma[0], "role") == "system") or (mb and _get(mb[0], "role") == "system"):
        order.append(("message", 0))
        start = 1
    order.append(("tools", -1))
    order += [("message", i) for i in range(start, max(len(ma), len(mb)))]
    for kind, i in order:
        if kind == "tools":
            if json.dumps(a.tools, sort_keys=False) == json.dumps(b.tools, sort_keys=False):
                continue
            ta, tb = a.tools or [], b.tools or []
            names = [_get(_get(t, "function"), "name") for t in tb if isinstance(t, dict)]
            if _canonical(ta) == _canonical(tb):
                words = (
                    "prefix mismatch in the tool definitions: the same JSON in another key order"
                )
            else:
                words = (
                    f"prefix mismatch in the tool definitions ({len(ta)} -> {len(tb)} tool(s): "
                    f"{', '.join(str(n) for n in names)})"
                )
            return Why("tools", words, None, "tools")
        if i >= len(ma) or i >= len(mb):
            more = "added" if i >= len(ma) else "removed"
            role = _get((mb if i < len(mb) else ma)[i], "role")
            return Why("message", f"message {i} ({role}) {more}", i, role)
        if json.dumps(ma[i], sort_keys=False) != json.dumps(mb[i], sort_keys=False):
            return _message_why(i, ma[i], mb[i], width)
    return None


def compare(a: Prompt, b: Prompt, width: int = 80) -> Why | None:
    if a.messages is not None and b.messages is not None:
        return compare_chat(a, b, width)
    if a.messages is not None or b.messages is not None:
        return Why("text", "one prompt is a chat, the other is not")
    return compare_text(a.text, b.text, width)


def traced(path: str, request: str) -> list[TraceEvent]:
    """The lookup lines of the trace about ``request`` (its id, or an id it begins:
    vLLM may add a suffix to a response's id)."""
    return [
        e
        for e in read(path, LOOKUP_KINDS)
        if e.request and (e.request == request or e.request.startswith(request))
    ]
