"""The ``KTM`` section of a checkpoint file: the seed's map, tool-call id -> the exact text
of the call, and its codec (bounded: every count and length is checked before use).

Pure: standard library only. The file's other structures are in ``format``; the replay
that reads these maps is ``replay.ktm``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from vllm_kvdisk.core.format import FormatError

KTM_MAGIC = b"KTM"
KTM_VERSION = 1
MAX_KTM_ENTRIES = 1 << 20
MAX_TOOL_ID_BYTES = 1024
MAX_TOOL_TEXT_BYTES = 1 << 20
MAX_KTM_BYTES = 64 << 20  # a whole tool map section, checked before it is read
KTM_HEAD = struct.Struct("<3sBI")
KTM_ENTRY = struct.Struct("<II")


def encode_tool_map(entries: Sequence[tuple[str, str]]) -> bytes:
    """The seed's KTM section: magic, version, count, then (id len, text len, id, text)."""
    if len(entries) > MAX_KTM_ENTRIES:
        raise FormatError(f"{len(entries)} tool-map entries > {MAX_KTM_ENTRIES}")
    parts = [KTM_HEAD.pack(KTM_MAGIC, KTM_VERSION, len(entries))]
    for tool_id, text in entries:
        raw_id, raw_text = tool_id.encode(), text.encode()
        if not 1 <= len(raw_id) <= MAX_TOOL_ID_BYTES or len(raw_text) > MAX_TOOL_TEXT_BYTES:
            raise FormatError(f"tool-map entry {tool_id[:40]!r} exceeds the size limits")
        parts += [KTM_ENTRY.pack(len(raw_id), len(raw_text)), raw_id, raw_text]
    return b"".join(parts)


def decode_tool_map(buf: bytes) -> list[tuple[str, str]]:
    if len(buf) < KTM_HEAD.size:
        raise FormatError("truncated tool map")
    magic, version, count = KTM_HEAD.unpack_from(buf)
    if magic != KTM_MAGIC or version != KTM_VERSION:
        raise FormatError(f"bad tool map magic/version {magic!r}/{version}")
    if count > MAX_KTM_ENTRIES:
        raise FormatError(f"tool map claims {count} entries > {MAX_KTM_ENTRIES}")
    pos, out = KTM_HEAD.size, []
    for _ in range(count):
        if pos + KTM_ENTRY.size > len(buf):
            raise FormatError("truncated tool map entry")
        id_len, text_len = KTM_ENTRY.unpack_from(buf, pos)
        pos += KTM_ENTRY.size
        if not 1 <= id_len <= MAX_TOOL_ID_BYTES or text_len > MAX_TOOL_TEXT_BYTES:
            raise FormatError("tool map entry exceeds the size limits")
        if pos + id_len + text_len > len(buf):
            raise FormatError("truncated tool map entry")
        try:
            tool_id = buf[pos : pos + id_len].decode()
            text = buf[pos + id_len : pos + id_len + text_len].decode()
        except UnicodeDecodeError:
            raise FormatError("tool map entry is not UTF-8") from None
        out.append((tool_id, text))
        pos += id_len + text_len
    if pos != len(buf):
        raise FormatError(f"{len(buf) - pos} trailing bytes after the tool map")
    return out
