"""Printing what clients wrote to an operator's terminal: escaped, never interpreted.

A checkpoint's text and tool ids are a client's prompt; ``namespace.json`` and file
contents may have been planted by anyone who can write the cache directory. Printed raw,
ESC sequences would retitle the terminal (OSC 0), write the clipboard (OSC 52), hide text
(CSI 8m) or reorder it (bidirectional overrides). ``say`` prints every character of the
Unicode categories Cc (C0, DEL, C1), Cf (format: bidi overrides, zero-width), Zl and Zp
as an escape (``\\x1b``, ``\\u202e``), newline, tab and CR as ``\\n``, ``\\t``, ``\\r``;
``say_json`` relies on JSON's own escaping (C0 and, with ``ensure_ascii``, everything
outside ASCII) and adds DEL.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

_NAMED_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def printable(text: str) -> str:
    """``text`` with every control character as an escape (``\\x1b``, ``\\u202e``): C0,
    DEL, C1, and the Unicode format, line and paragraph separator characters."""
    out = []
    for ch in text:
        if ch in _NAMED_ESCAPES:
            out.append(_NAMED_ESCAPES[ch])
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def say(text: str = "", *, file: Any = None) -> None:
    """Print lines (split at our own newlines), each with control characters escaped."""
    print("\n".join(printable(line) for line in str(text).split("\n")), file=file)


def say_json(obj: Any, **kwargs: Any) -> None:
    """JSON escapes C0 and (ensure_ascii) everything outside ASCII, not DEL."""
    print(json.dumps(obj, **kwargs).replace("\x7f", "\\u007f"))
