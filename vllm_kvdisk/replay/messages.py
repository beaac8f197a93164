"""What an assistant message says, normalised so that a message sent back by a client can be
compared with the one the model produced: JSON-equal arguments compare equal (key order
and spacing are the template's), content is compared without surrounding whitespace.
:func:`hidden_text` tells what a sampled turn says beyond what the client received (a
replay must never insert it).
Pure: standard library.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
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


# What may stay of a sampled turn once everything the client received is taken out of it:
# whitespace and the punctuation of a call syntax (JSON, tags). A letter or digit left is text the
# parser hid from the client (after ``</tool_call>``, between calls, an extra JSON key).
_SYNTAX = frozenset(' \t\r\n[]{},:;"<>/=')
# The keys of a JSON call object: syntax, even where a parser handed the client the rest of
# the object as a call's arguments (hermes' streaming does).
_CALL_KEYS = ("name", "arguments", "parameters", "function", "type", "id")
_DECODER = json.JSONDecoder()
_OPEN = re.compile(r"[{\[]")


def _visible_json(value: Any, signature: Signature, ids: Sequence[str]) -> bool:
    """Whether a JSON value in the sampled text carries only what the client received: a
    call's arguments, a call object (its name, its arguments, optionally its id and
    ``"type": "function"``), or a list of them."""
    if isinstance(value, list):
        return bool(value) and all(_visible_json(v, signature, ids) for v in value)
    if not isinstance(value, dict):
        return False
    calls = signature.calls
    if any(canonical_arguments(value) == args for _, args in calls):
        return True
    keys = set(value) - {"id", "type"}
    if keys not in ({"name", "arguments"}, {"name", "parameters"}):
        return False
    if "id" in value and value["id"] not in ids:
        return False
    if "type" in value and value["type"] != "function":
        return False
    args = canonical_arguments(value.get("arguments", value.get("parameters")))
    return (str(value["name"]), args) in calls


def _leaves(value: Any) -> Iterable[str]:
    """The keys and scalar values of parsed arguments, as text."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, str):
        yield value
    elif value is not None:
        yield json.dumps(value)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _words(strings: Iterable[str]) -> re.Pattern[str] | None:
    """Any of ``strings`` as a whole word (not inside a longer run of letters/digits)."""
    alts = sorted({x for x in strings if x.strip()}, key=len, reverse=True)
    if not alts:
        return None
    body = "|".join(re.escape(a) for a in alts)
    return re.compile(f"(?<![0-9A-Za-z])(?:{body})(?![0-9A-Za-z])")


def hidden_text(
    text: str, signature: Signature, ids: Sequence[str], markup: Iterable[str] = ()
) -> str:
    """What ``text`` (a sampled turn) says that the client's message does not: ``text``
    without the message's content, the JSON of its calls (arguments, or call objects), the
    ``markup`` strings (the tool parser's syntax, the tokenizer's special tokens), its call
    ids and names, the keys and values of its arguments and the keys of a JSON call object
    as whole words (a syntax that is not JSON writes them as tags or attributes), arguments
    that are not JSON as the client received them, and then without whitespace and syntax
    punctuation. Empty when the client received all of it. Linear in ``len(text)`` times
    the nesting depth of its JSON."""
    rest = text
    if signature.content:
        at = rest.find(signature.content)
        if at < 0:
            return signature.content  # the parser changed the content: nothing to compare
        rest = rest[:at] + " " + rest[at + len(signature.content) :]
    for _, args in signature.calls:  # arguments that are not JSON: as the client got them
        if args and not _is_json(args):
            rest = rest.replace(args, " ")
    kept, pos = [], 0
    while pos < len(rest):
        found = _OPEN.search(rest, pos)
        if found is None:
            break
        at = found.start()
        try:
            value, end = _DECODER.raw_decode(rest, at)
        except (ValueError, RecursionError):  # RecursionError: nesting past Python's limit
            value, end = None, at
        if end > at and _visible_json(value, signature, ids):
            kept.append(rest[pos:at] + " ")
            pos = end
        else:
            kept.append(rest[pos : at + 1])
            pos = at + 1
    rest = "".join(kept) + rest[pos:]
    strings = [m for m in markup if m] + list(ids) + [name for name, _ in signature.calls]
    for piece in sorted(set(strings), key=len, reverse=True):
        rest = rest.replace(piece, " ")
    leaves = list(_CALL_KEYS)
    for _, args in signature.calls:
        try:
            leaves += list(_leaves(json.loads(args)))
        except ValueError:
            leaves.append(args)
    words = _words(leaves)
    if words is not None:
        rest = words.sub(" ", rest)
    return "".join(c for c in rest if c not in _SYNTAX)
