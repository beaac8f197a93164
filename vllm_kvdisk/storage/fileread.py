"""Reading a ``.kv`` file (spec: docs/FORMAT.md; the structures are in ``format``).

* :func:`read_summary`: what an index needs, from the first bytes (a start-up scan).
* :func:`read_meta`: header, payload header and section sizes, cross-checked; then the
  sections: text, token ids (verified or a range) and tool map. The layers' pages are
  read by :mod:`.pageread`.

Every length is checked against its limit and the file size before anything is read or
allocated for it; anything wrong raises :class:`~vllm_kvdisk.core.format.FormatError`. Pure:
standard library and xxhash.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import xxhash

from vllm_kvdisk.core.codec import (
    CHUNK,
    PACK_HEADER,
    Packing,
    chunk_raw_bytes,
    decode_chunk,
    unpack_header,
    unpack_packing,
)
from vllm_kvdisk.core.format import (
    CHECKSUM,
    DTYPES,
    FLAG_DELTA,
    FLAG_TOOL_MAP,
    GROUP,
    GROUP_COUNT_AT,
    HEADER,
    MAX_GROUPS,
    MAX_LAYERS,
    MAX_TEXT_BYTES,
    PAGE_ALIGN,
    PAYLOAD_FIXED,
    PAYLOAD_MAGIC,
    PAYLOAD_VERSION_PACKED,
    PAYLOAD_VERSIONS,
    TEXT_LEN,
    FormatError,
    Header,
    Offsets,
    Payload,
    Summary,
    UnsupportedFile,
    compute_offsets,
    unpack_groups,
    unpack_payload_fixed,
)
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.core.toolmap import MAX_KTM_BYTES, decode_tool_map
from vllm_kvdisk.storage import fsdir

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Meta:
    """Everything about a checkpoint file except its text, token ids and pages."""

    header: Header
    payload: Payload
    offsets: Offsets
    text_len: int


_SUMMARY = struct.Struct("<4sHH32s20sII")  # magic .. block size (prefix of PAYLOAD_FIXED)
_LAYERS_AT = 4 + 2 + 2 + 32 + 20 + 4 + 4 + 4 + 4  # u32 layer count inside PAYLOAD_FIXED
_DIGEST_AT = PAYLOAD_FIXED.size - 16
_U16, _U32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")
_NO_PARENT = bytes(20)


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise FormatError(f"truncated file: wanted {size} bytes at {offset}, got {len(data)}")
    return data


def _read_opening(fd: int, file_size: int) -> tuple[Header, int, bytes]:
    """Header and text length from the first page, checked against the file size and the
    limits; returns (header, text length, the bytes read)."""
    first = os.pread(fd, PAGE_ALIGN, 0)
    header = Header.unpack(first)
    if len(first) < HEADER.size + TEXT_LEN.size:
        raise FormatError("truncated before the text length")
    (text_len,) = TEXT_LEN.unpack_from(first, HEADER.size)
    payload_at = HEADER.size + TEXT_LEN.size + text_len
    if text_len > MAX_TEXT_BYTES or payload_at > file_size:
        raise FormatError(f"text length {text_len} exceeds the file or the limit")
    if payload_at + header.payload_bytes > file_size:
        raise FormatError(f"file of {file_size} bytes is shorter than its sections")
    return header, text_len, first


def _read_span(fd: int, first: bytes, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset``, from the first page when they lie inside it."""
    if offset + size <= len(first):
        return first[offset : offset + size]
    return _pread_exact(fd, size, offset)


def read_summary(fd: int, file_size: int) -> Summary:
    """Header, parent, token digest and the first owned block's ids, checked for
    consistency, in one to three small reads (never the other token ids); the full parse
    and every checksum happen when the file is loaded. Raises FormatError like
    ``read_meta``. (The hot loop of a start-up scan: kept free of helpers.)"""
    header, text_len, buf = _read_opening(fd, file_size)
    payload_at = HEADER.size + TEXT_LEN.size + text_len
    base = 0
    if header.payload_bytes < PAYLOAD_FIXED.size:
        raise FormatError(f"payload of {header.payload_bytes} bytes < its fixed header")
    if payload_at + PAYLOAD_FIXED.size > len(buf):
        # The payload header and the checksum table follow each other: one read of that
        # span (bounded by MAX_LAYERS) holds what the first page did not. Not the token
        # ids: only the first owned block's are needed (512 KiB for 131k tokens, 64 B).
        span = min(
            header.payload_bytes,
            PAYLOAD_FIXED.size + GROUP.size * MAX_GROUPS + CHECKSUM.size * (MAX_LAYERS + 1),
        )
        buf, base = _pread_exact(fd, span, payload_at), payload_at
    magic, version, fixed_len, _, parent, parent_tokens, block_size = _SUMMARY.unpack_from(
        buf, payload_at - base
    )
    if magic != PAYLOAD_MAGIC:
        raise FormatError(f"bad payload magic {magic!r}")
    if version not in PAYLOAD_VERSIONS or fixed_len != PAYLOAD_FIXED.size:
        raise UnsupportedFile(f"payload version {version}/{fixed_len}")
    (layers,) = _U32.unpack_from(buf, payload_at - base + _LAYERS_AT)
    (groups,) = _U16.unpack_from(buf, payload_at - base + GROUP_COUNT_AT)
    has_parent = parent != _NO_PARENT
    if (
        has_parent != bool(header.flags & FLAG_DELTA)
        or parent_tokens >= header.tokens
        or has_parent != (parent_tokens > 0)
        or not 1 <= layers <= MAX_LAYERS
        or not 1 <= groups <= MAX_GROUPS
        or not 1 <= block_size <= header.tokens
        or parent_tokens % block_size
        or header.tokens % block_size
    ):
        raise FormatError("parent, block or layer fields inconsistent")
    (digest,) = _U64.unpack_from(buf, payload_at - base + _DIGEST_AT)
    ids_at = payload_at + PAYLOAD_FIXED.size + GROUP.size * groups + CHECKSUM.size * (layers + 1)
    if ids_at + 4 * (parent_tokens + block_size) > payload_at + header.payload_bytes:
        raise FormatError("token ids extend past the payload")
    head_at = ids_at + 4 * parent_tokens - base
    if head_at < 0 or head_at + 4 * block_size > len(buf):
        buf = _pread_exact(fd, 4 * block_size, ids_at + 4 * parent_tokens)
        head_at = 0
    head = xxhash.xxh3_64_intdigest(buf[head_at : head_at + 4 * block_size])
    return Summary(
        header, parent.hex() if has_parent else None, parent_tokens, digest, head, ids_at
    )


def read_meta(fd: int, file_size: int) -> Meta:
    """Parse and cross-check header, payload header and section sizes; no payload I/O."""
    header, text_len, first = _read_opening(fd, file_size)
    payload_at = HEADER.size + TEXT_LEN.size + text_len
    fixed_end = payload_at + PAYLOAD_FIXED.size
    payload = unpack_payload_fixed(_read_span(fd, first, payload_at, PAYLOAD_FIXED.size), header)
    groups_len = GROUP.size * len(payload.groups)
    if PAYLOAD_FIXED.size + groups_len > header.payload_bytes:
        raise FormatError("group table extends past the payload")
    payload = unpack_groups(_read_span(fd, first, fixed_end, groups_len), payload, header.tokens)
    count = payload.layout.num_layers + 1
    sums_raw = _read_span(fd, first, fixed_end + groups_len, CHECKSUM.size * count)
    payload = replace(payload, checksums=struct.unpack(f"<{count}Q", sums_raw))
    if payload.version == PAYLOAD_VERSION_PACKED:
        payload = replace(payload, packing=_read_packing(fd, first, header, payload, payload_at))
    offsets = compute_offsets(
        text_len,
        header.tokens,
        payload.layout,
        payload.layer_blocks(),
        0,
        len(payload.groups),
        payload.packing,
    )
    if offsets.ktm - offsets.payload != header.payload_bytes:
        raise FormatError(
            f"payload bytes {header.payload_bytes} != layout's {offsets.ktm - offsets.payload}"
        )
    ktm_len = file_size - offsets.ktm
    if bool(header.flags & FLAG_TOOL_MAP) != (ktm_len > 0) or ktm_len < 0:
        raise FormatError(f"file size {file_size} does not match its sections")
    if ktm_len > MAX_KTM_BYTES:
        raise FormatError(f"tool map of {ktm_len} bytes > {MAX_KTM_BYTES}")
    if ktm_len:
        offsets = compute_offsets(
            text_len,
            header.tokens,
            payload.layout,
            payload.layer_blocks(),
            ktm_len,
            len(payload.groups),
            payload.packing,
        )
    return Meta(header, payload, offsets, text_len)


def _read_packing(
    fd: int, first: bytes, header: Header, payload: Payload, payload_at: int
) -> Packing:
    """The chunk table of a compressed file (after the token ids), checked against the
    payload's size before it is read."""
    end = payload_at + header.payload_bytes
    table_at = (
        payload_at
        + PAYLOAD_FIXED.size
        + GROUP.size * len(payload.groups)
        + CHECKSUM.size * (payload.layout.num_layers + 1)
        + 4 * header.tokens
    )
    if table_at + PACK_HEADER.size > end:
        raise FormatError("packing header extends past the payload")
    head = _read_span(fd, first, table_at, PACK_HEADER.size)
    count = unpack_header(head)[2]
    if table_at + PACK_HEADER.size + CHUNK.size * count > end:
        raise FormatError(f"chunk table of {count} chunks extends past the payload")
    table = _read_span(fd, first, table_at + PACK_HEADER.size, CHUNK.size * count)
    lay = payload.layout
    return unpack_packing(head, table, payload.layer_blocks(), lay.page_bytes, DTYPES[lay.dtype][1])


def read_text(fd: int, meta: Meta, limit: int | None = None) -> bytes:
    """The rendered text, or its first ``limit`` bytes (a preview never reads a 1 GiB text)."""
    size = meta.text_len if limit is None else min(limit, meta.text_len)
    return _pread_exact(fd, size, meta.offsets.text)


#: the buffer of the whole-file checks (``kvdisk verify``): a file may claim a 1 GiB text
#: and layers of 256 GiB with a consistent size (a sparse file); memory stays this.
CHECK_CHUNK = 16 << 20


def _stream(
    fd: int, offset: int, size: int, update: Callable[[memoryview], None], buf: bytearray
) -> None:
    """Feed ``size`` bytes at ``offset`` to ``update`` through ``buf``, chunk by chunk."""
    view = memoryview(buf)
    while size > 0:
        got = os.preadv(fd, [view[: min(size, len(buf))]], offset)
        if got <= 0:
            raise FormatError(f"truncated file: {size} bytes missing at {offset}")
        update(view[:got])
        offset += got
        size -= got


def text_sha1(fd: int, meta: Meta, chunk: int = CHECK_CHUNK) -> str:
    """Hex SHA1 of the text (what the file's name must be), in bounded memory."""
    hasher = hashlib.sha1()
    _stream(
        fd,
        meta.offsets.text,
        meta.text_len,
        hasher.update,
        bytearray(max(1, min(chunk, meta.text_len))),
    )
    return hasher.hexdigest()


def check_layers(fd: int, meta: Meta, chunk: int = CHECK_CHUNK) -> None:
    """Verify every layer's checksum in bounded memory; FormatError on a mismatch.
    Compressed pages: every chunk's stored and decoded checksums, and each layer's
    checksum over its decoded pages."""
    if meta.payload.packing is not None:
        _check_packed(fd, meta)
        return
    n_layers = meta.payload.layout.num_layers
    biggest = max(meta.offsets.layer_size(i) for i in range(n_layers))
    buf = bytearray(max(1, min(chunk, biggest)))
    for layer in range(n_layers):
        hasher = xxhash.xxh3_64()
        _stream(fd, meta.offsets.layer(layer), meta.offsets.layer_size(layer), hasher.update, buf)
        if hasher.intdigest() != meta.payload.checksums[layer + 1]:
            raise FormatError(f"checksum mismatch in layer {layer}")


def _check_packed(fd: int, meta: Meta) -> None:
    packing, lay = meta.payload.packing, meta.payload.layout
    if packing is None:
        raise ValueError("not a compressed file")
    page = lay.page_bytes
    biggest = packing.chunk_pages * page
    out = bytearray(biggest)
    for layer, (_, pages) in enumerate(meta.payload.layer_blocks()):
        hasher = xxhash.xxh3_64()
        for i, k in enumerate(packing.layer_chunks(layer)):
            stored = memoryview(
                _pread_exact(fd, packing.chunks[k].stored, meta.offsets.pages + packing.chunk_at[k])
            )
            view = memoryview(out)[: chunk_raw_bytes(packing, pages, page, i)]
            decode_chunk(stored, packing.chunks[k], packing.planes, view)
            hasher.update(view)
        if hasher.intdigest() != meta.payload.checksums[layer + 1]:
            raise FormatError(f"checksum mismatch in layer {layer}")


def read_token_range(fd: int, ids_at: int, start: int, stop: int) -> bytes:
    """Stored token ids ``[start, stop)`` (u32 LE), unverified: callers compare them with
    the ids they expect, which is a stronger check than the checksum."""
    return _pread_exact(fd, 4 * (stop - start), ids_at + 4 * start)


def read_tokens(fd: int, meta: Meta) -> bytes:
    """Token ids (u32 LE) after checking the head+tokens checksum."""
    head_at = meta.offsets.payload
    raw = _pread_exact(fd, meta.offsets.tokens - head_at + 4 * meta.header.tokens, head_at)
    fixed = raw[: PAYLOAD_FIXED.size + GROUP.size * len(meta.payload.groups)]
    tokens = raw[meta.offsets.tokens - head_at :]
    if xxhash.xxh3_64_intdigest(fixed + tokens) != meta.payload.checksums[0]:
        raise FormatError("checksum mismatch in payload header or token ids")
    return tokens


def read_tool_map(fd: int, meta: Meta) -> list[tuple[str, str]]:
    size = meta.offsets.total - meta.offsets.ktm
    if not size:
        return []
    raw = _pread_exact(fd, size, meta.offsets.ktm)
    if xxhash.xxh3_64_intdigest(raw) != meta.payload.ktm_checksum:
        raise FormatError("checksum mismatch in the tool map")
    return decode_tool_map(raw)


def read_indexable(dir_fd: int, sha1: str) -> tuple[Any, int]:
    """((summary, size, inode, mtime ns) of one file, the exception it raised, or None
    if gone; the descriptor it was read through, or -1). The caller closes it."""
    try:
        fd = fsdir.open_regular(f"{sha1}.kv", dir_fd)
    except FileNotFoundError:
        return None, -1
    except OSError as exc:
        return exc, -1
    try:
        st = os.fstat(fd)
    except OSError as exc:
        fsdir.close_read(fd)
        return exc, -1
    try:
        return (read_summary(fd, st.st_size), st.st_size, st.st_ino, st.st_mtime_ns), fd
    except (FormatError, OSError) as exc:
        exc.inode, exc.dev = st.st_ino, st.st_dev  # type: ignore[union-attr]
        exc.size = st.st_size  # type: ignore[union-attr]
        return exc, fd
    except Exception as exc:  # noqa: BLE001 - a bug of ours, not proof of corruption
        log.exception("kvdisk: cannot index %s.kv; leaving it alone", sha1)
        found = UnsupportedFile(f"could not be indexed: {exc!r}")
        found.inode = st.st_ino  # type: ignore[attr-defined]
        return found, fd


def check_whole(fd: int, sha1: str, ns: str) -> Summary:
    """Every check ``kvdisk verify`` makes, on a file not indexed yet (a download): its
    name is the SHA1 of its text, its namespace digest starts with ``ns``, its token ids,
    pages and tool map match their checksums. Its summary; FormatError if unsound
    (UnsupportedFile: another version, not corrupt)."""
    size = os.fstat(fd).st_size
    meta = read_meta(fd, size)
    if text_sha1(fd, meta) != sha1:
        raise FormatError("file name is not the SHA1 of its text")
    if not meta.payload.fingerprint.hex().startswith(ns):
        raise FormatError("a file of another namespace")
    read_tokens(fd, meta)
    check_layers(fd, meta)
    read_tool_map(fd, meta)
    return read_summary(fd, size)
