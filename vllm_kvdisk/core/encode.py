"""Writing a ``.kv`` file: a checkpoint laid out for ``writev`` (spec: docs/FORMAT.md; the
structures are in ``format``), from a save plan or from its parts, and the summary a scan
would read back of it.

Pure: numpy and xxhash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from vllm_kvdisk.core.codec import pack_layers
from vllm_kvdisk.core.format import (
    CHECKSUM,
    DTYPES,
    FLAG_DELTA,
    FLAG_TOOL_MAP,
    FULL_ONLY,
    MAX_GROUPS,
    MAX_TEXT_BYTES,
    MAX_TOKENS,
    PAYLOAD_VERSION,
    PAYLOAD_VERSION_PACKED,
    PAYLOAD_VERSION_STATE,
    TEXT_LEN,
    FormatError,
    Group,
    Header,
    Offsets,
    PageLayout,
    Payload,
    Reason,
    Summary,
    compute_offsets,
    dtype_code,
    has_state,
    pack_groups,
    pack_payload_fixed,
)
from vllm_kvdisk.core.keys import token_digest
from vllm_kvdisk.core.toolmap import MAX_KTM_BYTES, encode_tool_map

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from vllm_kvdisk.core.planner import SavePlan


@dataclass(frozen=True, slots=True)
class Encoded:
    """A checkpoint ready for ``writev``: buffers in file order and its final size."""

    buffers: list[Buffer]
    size: int
    header: Header
    payload: Payload
    offsets: Offsets
    head: int  # xxh3-64 of the first owned block's token ids (the index's walk key)

    @property
    def raw_page_bytes(self) -> int:
        """The pages' bytes decoded (``stored_page_bytes`` once compressed)."""
        return self.offsets.raw_bytes

    @property
    def stored_page_bytes(self) -> int:
        return self.offsets.stored_bytes


def encode_checkpoint(
    *,
    text: bytes,
    tokens: bytes,
    layers: Sequence[Buffer],
    payload: Payload,
    reason: Reason,
    kv_dtype: str,
    context_size: int,
    now: int,
    tool_map: Sequence[tuple[str, str]] = (),
    compress: bool = False,
    window_held: int = 0,
) -> Encoded:
    """Lay out one checkpoint. ``tokens`` is the u32 LE token ids of the whole prefix;
    ``compress``: pages in compressed chunks (payload version 4, ``codec``);
    ``window_held``: what the window groups leave to the parent's chain
    (``format.window_held``)."""
    lay = payload.layout
    lay.validate()
    n_tokens = len(tokens) // 4
    if len(tokens) % 4 or not 1 <= n_tokens <= MAX_TOKENS or len(text) > MAX_TEXT_BYTES:
        raise FormatError("token ids or text outside the limits")
    if len(layers) != lay.num_layers:
        raise FormatError(f"{len(layers)} layer buffers for {lay.num_layers} layers")
    ktm = encode_tool_map(tool_map) if tool_map else b""
    if len(ktm) > MAX_KTM_BYTES:
        raise FormatError(f"tool map of {len(ktm)} bytes > {MAX_KTM_BYTES}")
    groups = payload.groups
    if len(groups) == 1 and groups[0].layers == 0:
        groups = (replace(groups[0], layers=lay.num_layers),)
    if not 1 <= len(groups) <= MAX_GROUPS or sum(g.layers for g in groups) != lay.num_layers:
        raise FormatError(
            f"{len(groups)} groups of {[g.layers for g in groups]} layers "
            f"for {lay.num_layers} layers"
        )
    if window_held not in (0, payload.parent_tokens):
        raise FormatError(f"window groups held below {window_held}, not 0 or the parent's share")
    groups = tuple(
        g.placed(payload.parent_tokens, n_tokens, lay.block_size, window_held) for g in groups
    )
    payload = replace(
        payload,
        groups=groups,
        version=PAYLOAD_VERSION_STATE if has_state(groups) else PAYLOAD_VERSION,
    )
    layer_blocks = payload.layer_blocks()
    for i, buf in enumerate(layers):
        want = layer_blocks[i][1] * lay.page_bytes
        if memoryview(buf).nbytes != want:
            raise FormatError(
                f"layer {i} buffer of {memoryview(buf).nbytes} bytes, expected {want}"
            )
    stored: list[Buffer] = list(layers)
    if compress:
        packed = pack_layers(layers, layer_blocks, lay.page_bytes, DTYPES[lay.dtype][1])
        payload = replace(payload, version=PAYLOAD_VERSION_PACKED, packing=packed.packing)
        stored = list(packed.buffers)
    offsets = compute_offsets(
        len(text), n_tokens, lay, layer_blocks, len(ktm), len(groups), payload.packing
    )
    payload = replace(payload, ktm_checksum=xxhash.xxh3_64_intdigest(ktm) if ktm else 0)
    fixed = pack_payload_fixed(payload) + pack_groups(groups)
    sums = [xxhash.xxh3_64_intdigest(fixed + tokens)]
    sums += [xxhash.xxh3_64_intdigest(buf) for buf in layers]
    payload = replace(payload, checksums=tuple(sums))
    flags = (FLAG_TOOL_MAP if ktm else 0) | (FLAG_DELTA if payload.parent_sha1 else 0)
    header = Header(
        dtype_code(kv_dtype),
        reason,
        flags,
        n_tokens,
        0,
        context_size,
        now,
        now,
        offsets.ktm - offsets.payload,
    )
    table = payload.packing.pack() if payload.packing is not None else b""
    pad = bytes(offsets.pages - offsets.tokens - len(tokens) - len(table))
    buffers: list[Buffer] = [
        header.pack(),
        TEXT_LEN.pack(len(text)),
        text,
        fixed,
        b"".join(CHECKSUM.pack(s) for s in sums),
        tokens,
        table,
        pad,
    ]
    buffers += stored
    if ktm:
        buffers.append(ktm)
    first = payload.parent_tokens
    head = xxhash.xxh3_64_intdigest(tokens[4 * first : 4 * (first + lay.block_size)])
    return Encoded(buffers, offsets.total, header, payload, offsets, head)


def summary_of(encoded: Encoded) -> Summary:
    """The summary of a checkpoint just encoded (what a scan would read back)."""
    p = encoded.payload
    return Summary(
        encoded.header,
        p.parent_sha1,
        p.parent_tokens,
        p.token_digest,
        encoded.head,
        encoded.offsets.tokens,
    )


def encode_plan(
    plan: SavePlan,
    *,
    text: bytes,
    ids: np.ndarray | bytes,
    layers: Sequence[Buffer],
    layout: PageLayout,
    fingerprint: bytes,
    kv_dtype: str,
    context_size: int,
    now: int,
    tool_map: Sequence[tuple[str, str]] = (),
    groups: Sequence[Group] = FULL_ONLY,
    compress: bool = False,
) -> Encoded:
    """Encode the file of ``plan``; ``layers`` hold, per layer in group order, the pages of
    the blocks its group stores (``Group.placed``) and ``ids`` the token ids of (at least)
    the whole prefix."""
    bs = layout.block_size
    if isinstance(ids, (bytes, bytearray, memoryview)):
        ids = np.frombuffer(ids, dtype="<u4")
    tokens = np.ascontiguousarray(ids[: plan.tokens], dtype="<u4")
    payload = Payload(
        fingerprint,
        plan.parent,
        plan.parent_tokens,
        plan.parent_tokens // bs,
        (plan.tokens - plan.parent_tokens) // bs,
        layout,
        token_digest(tokens),
        groups=tuple(groups),
    )
    return encode_checkpoint(
        text=text,
        tokens=tokens.tobytes(),
        layers=layers,
        payload=payload,
        reason=plan.reason,
        kv_dtype=kv_dtype,
        context_size=context_size,
        now=now,
        tool_map=tool_map,
        compress=compress,
        window_held=plan.window_held,
    )
