"""What an assistant message says, normalised so that a message sent back by a client can be
compared with the one the model produced: JSON-equal arguments compare equal (key order
and spacing are the template's), content is compared without surrounding whitespace.
Pure: standard library.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Signature:
    """An assistant message as the client sees it, normalised for comparison."""

    content: str
    calls: tuple[tuple[str, str], ...]  # (name, canonical arguments)
    reasoning: str = ""


def canonical_arguments(arguments: Any) -> str:
    """JSON-equal arguments compare equal (key order and spacing are the template's)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    try:
        return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return str(arguments)


def plain_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):  # OpenAI content parts
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        ).strip()
    return str(content).strip()


def make_signature(
    content: Any, calls: Iterable[tuple[str, Any]], reasoning: Any = None
) -> Signature:
    return Signature(
        plain_text(content),
        tuple((str(name), canonical_arguments(args)) for name, args in calls),
        plain_text(reasoning),
    )


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def message_tool_ids(message: Any) -> list[str]:
    if _get(message, "role") != "assistant":
        return []
    return [str(_get(tc, "id")) for tc in (_get(message, "tool_calls") or []) if _get(tc, "id")]


def message_signature(message: Any) -> Signature:
    calls = []
    for tc in _get(message, "tool_calls") or []:
        fn = _get(tc, "function") or {}
        calls.append((_get(fn, "name") or "", _get(fn, "arguments")))
    reasoning = _get(message, "reasoning") or _get(message, "reasoning_content")
    return make_signature(_get(message, "content"), calls, reasoning)
