"""The ``.kv`` checkpoint file: its structures, limits and their checks (spec: docs/FORMAT.md).

Invariants:
* Every integer is little-endian; every length is checked against a stated maximum and
  against the file size *before* anything is allocated for it.
* A file either parses completely and consistently or raises :class:`FormatError`
  (corrupt, truncated, hostile) / :class:`UnsupportedFile` (a version or feature this
  build does not read). Callers turn both into a cache miss; nothing else escapes.
* Page data are opaque: whole blocks, layer by layer, each layer guarded by its own
  xxh3-64, so a restore can read and verify one layer at a time (into staging or
  straight into its destination blocks).
* Layers come in KV cache groups (format v2): a full-attention group's layers hold the
  blocks the file owns, ``[parent_tokens, tokens)``; a sliding-window group's layers hold
  the window a hit at ``tokens`` needs, ``window_blocks(tokens, window, block)``, less the
  blocks below ``parent_tokens`` when the parent ends there (its chain holds those:
  ``window_held``); a state group's layers (Mamba / Gated-DeltaNet) hold one block, the state
  after exactly ``tokens`` tokens. Every group's range is checked against that rule when a
  file is read. Files with a state group carry payload version 3, so a build that knows
  only version 2 leaves them alone (unsupported) instead of calling them corrupt.
* No pickle, no eval: only ``struct`` and raw bytes.

Pure: standard library only. Writing a file is ``encode``; reading one is
``storage.fileread``; the tool-map section is ``toolmap``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import TYPE_CHECKING

# Re-exported: the readers name them as parts of the format.
from vllm_kvdisk.core.errors import FormatError as FormatError
from vllm_kvdisk.core.errors import UnsupportedFile as UnsupportedFile

if TYPE_CHECKING:
    from vllm_kvdisk.core.codec import Packing

FORMAT_VERSION = 2
MAGIC = b"KVC"
PAYLOAD_MAGIC = b"KVDP"
PAYLOAD_VERSION = 2  # files without a state group
PAYLOAD_VERSION_STATE = 3  # files with one (a reader of version 2 leaves them alone)
PAYLOAD_VERSION_PACKED = 4  # compressed pages (``codec``), with or without a state group
# Every payload version ``encode`` writes: every reader (a file's summary for the index, its
# full parse for a load or ``kvdisk verify``) accepts each of them, from this one tuple.
PAYLOAD_VERSIONS = (PAYLOAD_VERSION, PAYLOAD_VERSION_STATE, PAYLOAD_VERSION_PACKED)
PAGE_ALIGN = 4096

MAX_TOKENS = 1 << 24
MAX_TEXT_BYTES = 1 << 30
MAX_LAYERS = 1024
MAX_PAGE_BYTES = 1 << 28
MAX_PAGE_DIMS = 6
MAX_GROUPS = 64

FLAG_TOOL_MAP = 1 << 0
FLAG_DELTA = 1 << 1
FLAG_LOGITS = 1 << 2  # reserved: vLLM always recomputes the last prompt token
KNOWN_FLAGS = FLAG_TOOL_MAP | FLAG_DELTA | FLAG_LOGITS

HEADER = struct.Struct("<3sBBBHIIQQQQ")  # 48 bytes
TEXT_LEN = struct.Struct("<I")
# magic, version, fixed length, fingerprint, parent sha1, parent tokens, block size,
# first block, blocks, layers, page bytes, tp rank, tp size, page dtype, page ndim,
# group count, 6 page dims, layout name, token digest, KTM checksum
PAYLOAD_FIXED = struct.Struct("<4sHH32s20sIIIIIQHHBBH6I24sQQ")
# one KV cache group: kind, zero, layers, window tokens, first block, block count
GROUP = struct.Struct("<BBHIII")
GROUP_COUNT_AT = 94  # u16 inside PAYLOAD_FIXED
CHECKSUM = struct.Struct("<Q")
HEADER_FIELD_HITS = 12
HEADER_FIELD_LAST_USED = 32
if HEADER.size != 48 or PAYLOAD_FIXED.size != 160 or GROUP.size != 16:  # the spec pins both sizes
    raise RuntimeError("struct layout drifted from docs/FORMAT.md")


class Reason(IntEnum):
    COLD = 1
    CONTINUED = 2
    EVICT = 3
    SHUTDOWN = 4


DTYPES: dict[str, tuple[int, int]] = {  # name -> (code, bytes per element)
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "fp8_e4m3": (4, 1),
    "fp8_e5m2": (5, 1),
    "uint8": (6, 1),
}
DTYPE_NAMES = {code: name for name, (code, _) in DTYPES.items()}
_REASONS = {int(r): r for r in Reason}


def dtype_code(name: str) -> int:
    try:
        return DTYPES[name][0]
    except KeyError:
        raise UnsupportedFile(
            f"KV dtype {name!r} has no code in format v{FORMAT_VERSION}"
        ) from None


@dataclass(frozen=True, slots=True)
class Header:
    kv_dtype: int
    reason: Reason
    flags: int
    tokens: int
    hits: int
    context_size: int
    created: int
    last_used: int
    payload_bytes: int
    version: int = FORMAT_VERSION

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            self.version,
            self.kv_dtype,
            int(self.reason),
            self.flags,
            self.tokens,
            self.hits,
            self.context_size,
            self.created,
            self.last_used,
            self.payload_bytes,
        )

    @classmethod
    def unpack(cls, buf: bytes) -> Header:
        if len(buf) < HEADER.size:
            raise FormatError(f"truncated header: {len(buf)} of {HEADER.size} bytes")
        (
            magic,
            version,
            kv_dtype,
            reason,
            flags,
            tokens,
            hits,
            ctx,
            created,
            last_used,
            payload,
        ) = HEADER.unpack_from(buf)
        if magic != MAGIC:
            raise FormatError(f"bad magic {magic!r}: not a KVC file")
        if version != FORMAT_VERSION:
            raise UnsupportedFile(f"format version {version}, this build reads {FORMAT_VERSION}")
        if kv_dtype not in DTYPE_NAMES:
            raise FormatError(f"unknown KV dtype code {kv_dtype}")
        save_reason = _REASONS.get(reason)
        if save_reason is None:
            raise FormatError(f"unknown save reason {reason}")
        if flags & ~KNOWN_FLAGS:
            raise FormatError(f"unknown flag bits {flags:#06x}")
        if flags & FLAG_LOGITS:
            raise UnsupportedFile("file carries logits (flag bit 2); this build never writes them")
        if not 1 <= tokens <= MAX_TOKENS:
            raise FormatError(f"token count {tokens} outside 1..{MAX_TOKENS}")
        return cls(
            kv_dtype, save_reason, flags, tokens, hits, ctx, created, last_used, payload, version
        )


@dataclass(frozen=True, slots=True)
class PageLayout:
    """How one block of one layer looks in the engine: copied as an opaque page."""

    name: str  # backend/layout, e.g. "cpu:LBHNC"
    block_size: int
    num_layers: int
    page_shape: tuple[int, ...]
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def page_bytes(self) -> int:
        n = DTYPES[self.dtype][1]
        for dim in self.page_shape:
            n *= dim
        return n

    def validate(self) -> None:
        if not self.name or len(self.name.encode()) > 24 or not self.name.isascii():
            raise FormatError(f"layout name {self.name!r} must be 1..24 ASCII bytes")
        if not 1 <= self.block_size <= MAX_TOKENS or not 1 <= self.num_layers <= MAX_LAYERS:
            raise FormatError(
                f"block size {self.block_size} / layers {self.num_layers} out of range"
            )
        if not 1 <= len(self.page_shape) <= MAX_PAGE_DIMS or min(self.page_shape) < 1:
            raise FormatError(f"bad page shape {self.page_shape}")
        if self.dtype not in DTYPES:
            raise FormatError(f"unknown page dtype {self.dtype!r}")
        if not 1 <= self.page_bytes <= MAX_PAGE_BYTES:
            raise FormatError(f"page of {self.page_bytes} bytes outside 1..{MAX_PAGE_BYTES}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise FormatError(f"tp rank {self.tp_rank} not below tp size {self.tp_size}")


class GroupKind(IntEnum):
    FULL = 1  # full attention: the blocks the file owns
    WINDOW = 2  # sliding window: the window a hit at the file's end needs
    STATE = 3  # Mamba / linear attention: the state after the file's last token


def state_block(tokens: int, block_size: int) -> int:
    """The block that holds a state group's state after ``tokens`` tokens (vLLM's Mamba
    "align" mode: block ``p`` holds the state after exactly ``(p + 1) * block_size``)."""
    return tokens // block_size - 1


def window_blocks(tokens: int, window: int, block_size: int, held: int = 0) -> tuple[int, int]:
    """``(first block, block count)`` a sliding-window group stores for a hit at ``tokens``:
    vLLM frees the blocks before token ``tokens - window + 1`` (its skipped tokens) and
    attends to the rest. ``held``: the tokens below which the chain under the file holds
    every window block already (``window_held``), so the file stores only the blocks from
    there."""
    first = max(max(0, tokens - window + 1) // block_size, held // block_size)
    return first, tokens // block_size - first


def window_held(parent_tokens: int, parent_end: int | None) -> int:
    """What a delta's window groups leave to its parent's chain: everything below
    ``parent_tokens`` when the parent ends there (that chain holds the window before the
    parent's end, which covers the part of this file's window below ``parent_tokens``),
    nothing when the parent ends later (a branch inside it: its window lies past this
    file's start) or there is none. ``parent_end``: the parent's token count."""
    return parent_tokens if parent_tokens and parent_end == parent_tokens else 0


@dataclass(frozen=True, slots=True)
class Group:
    """One KV cache group of the file: its kind, its layers' count and the blocks each of
    its layers holds, ``[first_block, first_block + num_blocks)``."""

    kind: GroupKind
    layers: int
    window: int = 0  # tokens (window groups): vLLM's window plus any retained tokens
    first_block: int = 0
    num_blocks: int = 0

    def placed(self, parent_tokens: int, tokens: int, block_size: int, held: int = 0) -> Group:
        """This group with the block range a file ``[parent_tokens, tokens)`` holds
        (``held``: a window group's part left to the parent's chain, ``window_held``)."""
        if self.kind == GroupKind.WINDOW:
            first, count = window_blocks(tokens, self.window, block_size, held)
        elif self.kind == GroupKind.STATE:
            first, count = state_block(tokens, block_size), 1
        else:
            first, count = parent_tokens // block_size, (tokens - parent_tokens) // block_size
        return replace(self, first_block=first, num_blocks=count)


FULL_ONLY = (Group(GroupKind.FULL, 0),)  # a model with one full-attention group


def is_hybrid(groups: Sequence[Group]) -> bool:
    """Several KV cache groups, or a sliding window or state: block ids go per group, and
    vLLM frees a window's blocks (and a state's) once the tokens past it are computed."""
    return len(groups) > 1 or any(g.kind != GroupKind.FULL for g in groups)


def has_state(groups: Sequence[Group]) -> bool:
    """A group keeps a recurrent state: a hit must end where a file's state is stored."""
    return any(g.kind == GroupKind.STATE for g in groups)


@dataclass(frozen=True, slots=True)
class Payload:
    """The payload's own header: what the pages are and what they extend."""

    fingerprint: bytes  # 32-byte namespace digest
    parent_sha1: str | None
    parent_tokens: int
    first_block: int
    num_blocks: int
    layout: PageLayout
    token_digest: int
    ktm_checksum: int = 0
    checksums: tuple[int, ...] = field(default=())  # [head+tokens, layer 0, layer 1, ...]
    # The file's KV cache groups, layers in this order. Encoding places each group
    # (``Group.placed``); a layer count of 0 in a lone group means every layer.
    groups: tuple[Group, ...] = FULL_ONLY
    # 3 if a group holds a state, 4 if the pages are compressed (``encode`` sets it)
    version: int = PAYLOAD_VERSION
    packing: Packing | None = None  # the chunk table of compressed pages (version 4)

    def layer_blocks(self) -> list[tuple[int, int]]:
        """``(first block, block count)`` of every layer, in file order."""
        return [(g.first_block, g.num_blocks) for g in self.groups for _ in range(g.layers)]

    def group_of_layer(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) for _ in range(g.layers)]


@dataclass(frozen=True, slots=True)
class Offsets:
    """Absolute byte offsets of every section, derived from header + payload header."""

    text: int
    payload: int
    tokens: int
    pages: int
    layer_at: tuple[int, ...]  # layer i's pages are stored in [layer_at[i], layer_at[i + 1])
    ktm: int
    total: int
    raw_sizes: tuple[int, ...]  # layer i's pages, decoded (= stored for raw pages)
    table: int = 0  # the packing header and chunk table (compressed pages), else 0

    def layer(self, index: int) -> int:
        return self.layer_at[index]

    def layer_size(self, index: int) -> int:
        """Layer ``index``'s pages in bytes, decoded: what a reader's buffers hold."""
        return self.raw_sizes[index]

    def stored_size(self, index: int) -> int:
        """Layer ``index``'s bytes in the file (compressed or not)."""
        return self.layer_at[index + 1] - self.layer_at[index]

    @property
    def raw_bytes(self) -> int:
        return sum(self.raw_sizes)

    @property
    def stored_bytes(self) -> int:
        return self.layer_at[-1] - self.layer_at[0]

    @property
    def layer_bytes(self) -> int:
        """The bytes of every layer, for a file whose layers all hold the same blocks."""
        sizes = {self.layer_size(i) for i in range(len(self.layer_at) - 1)}
        if len(sizes) != 1:
            raise ValueError("the layers of this file hold different block ranges")
        return sizes.pop()


def compute_offsets(
    text_len: int,
    tokens: int,
    layout: PageLayout,
    layer_blocks: Sequence[tuple[int, int]],
    ktm_len: int,
    groups: int = 1,
    packing: Packing | None = None,
) -> Offsets:
    """Every section's offset; compressed pages (``packing``) follow their chunk table,
    which follows the token ids."""
    text = HEADER.size + TEXT_LEN.size
    payload = text + text_len
    tokens_at = (
        payload + PAYLOAD_FIXED.size + GROUP.size * groups + CHECKSUM.size * (len(layer_blocks) + 1)
    )
    table = tokens_at + 4 * tokens if packing is not None else 0
    head_end = table + packing.table_bytes if packing is not None else tokens_at + 4 * tokens
    pages = -(-head_end // PAGE_ALIGN) * PAGE_ALIGN
    raw = tuple(count * layout.page_bytes for _, count in layer_blocks)
    if packing is None:
        at = [pages]
        for size in raw:
            at.append(at[-1] + size)
    else:
        at = [pages + packing.chunk_at[k] for k in packing.layer_first]
    return Offsets(text, payload, tokens_at, pages, tuple(at), at[-1], at[-1] + ktm_len, raw, table)


def pack_payload_fixed(p: Payload) -> bytes:
    lay = p.layout
    shape = tuple(lay.page_shape) + (0,) * (MAX_PAGE_DIMS - len(lay.page_shape))
    parent = bytes.fromhex(p.parent_sha1) if p.parent_sha1 else bytes(20)
    return PAYLOAD_FIXED.pack(
        PAYLOAD_MAGIC,
        p.version,
        PAYLOAD_FIXED.size,
        p.fingerprint,
        parent,
        p.parent_tokens,
        lay.block_size,
        p.first_block,
        p.num_blocks,
        lay.num_layers,
        lay.page_bytes,
        lay.tp_rank,
        lay.tp_size,
        DTYPES[lay.dtype][0],
        len(lay.page_shape),
        len(p.groups),
        *shape,
        lay.name.encode().ljust(24, b"\0"),
        p.token_digest,
        p.ktm_checksum,
    )


def unpack_payload_fixed(buf: bytes, header: Header) -> Payload:
    if len(buf) < PAYLOAD_FIXED.size:
        raise FormatError("truncated payload header")
    (
        magic,
        version,
        fixed_len,
        fingerprint,
        parent,
        parent_tokens,
        block_size,
        first_block,
        num_blocks,
        num_layers,
        page_bytes,
        tp_rank,
        tp_size,
        dtype,
        ndim,
        n_groups,
        *rest,
    ) = PAYLOAD_FIXED.unpack_from(buf)
    shape_all, name, digest, ktm_sum = rest[:6], rest[6], rest[7], rest[8]
    if magic != PAYLOAD_MAGIC:
        raise FormatError(f"bad payload magic {magic!r}")
    if version not in PAYLOAD_VERSIONS or fixed_len != PAYLOAD_FIXED.size:
        raise UnsupportedFile(f"payload version {version}/{fixed_len}")
    if not 1 <= n_groups <= MAX_GROUPS:
        raise FormatError(f"group count {n_groups} outside 1..{MAX_GROUPS}")
    if not 1 <= ndim <= MAX_PAGE_DIMS or any(shape_all[ndim:]):
        raise FormatError("bad page shape fields")
    if dtype not in DTYPE_NAMES:
        raise FormatError(f"unknown page dtype code {dtype}")
    name_bytes = name.rstrip(b"\0")
    if b"\0" in name_bytes or not name_bytes.isascii():
        raise FormatError("bad layout name")
    if dtype != header.kv_dtype:
        raise FormatError(f"header KV dtype {header.kv_dtype} != page dtype {dtype}")
    layout = PageLayout(
        name_bytes.decode(),
        block_size,
        num_layers,
        tuple(shape_all[:ndim]),
        DTYPE_NAMES[dtype],
        tp_rank,
        tp_size,
    )
    layout.validate()
    if layout.page_bytes != page_bytes:
        raise FormatError(f"page bytes {page_bytes} != shape x dtype {layout.page_bytes}")
    has_parent = parent != bytes(20)
    if has_parent != bool(header.flags & FLAG_DELTA):
        raise FormatError("delta flag and parent field disagree")
    if has_parent != (parent_tokens > 0) or parent_tokens >= header.tokens:
        raise FormatError(f"parent token count {parent_tokens} inconsistent")
    if parent_tokens % block_size or header.tokens % block_size:
        raise FormatError("checkpoint boundaries are not block-aligned")
    if first_block * block_size != parent_tokens:
        raise FormatError("first block does not start at the parent's end")
    if (first_block + num_blocks) * block_size != header.tokens:
        raise FormatError("owned blocks do not end at the token count")
    return Payload(
        fingerprint,
        parent.hex() if has_parent else None,
        parent_tokens,
        first_block,
        num_blocks,
        layout,
        digest,
        ktm_sum,
        groups=(Group(GroupKind.FULL, 0),) * n_groups,  # read by unpack_groups
        version=version,
    )


def pack_groups(groups: Sequence[Group]) -> bytes:
    return b"".join(
        GROUP.pack(int(g.kind), 0, g.layers, g.window, g.first_block, g.num_blocks) for g in groups
    )


def unpack_groups(buf: bytes, payload: Payload, tokens: int) -> Payload:
    """The group table after the payload header (``len(payload.groups)`` records), checked:
    known kinds, layer counts adding up to the layer count, every group's block range the
    one its kind gives for this file."""
    count = len(payload.groups)
    if len(buf) < GROUP.size * count:
        raise FormatError("truncated group table")
    lay, groups = payload.layout, []
    for i in range(count):
        kind, zero, layers, window, first, blocks = GROUP.unpack_from(buf, GROUP.size * i)
        if zero or kind not in tuple(GroupKind) or layers < 1:
            raise FormatError(f"group {i}: bad kind {kind} or layer count {layers}")
        if (kind == GroupKind.WINDOW) != (window > 0) or window > MAX_TOKENS:
            raise FormatError(f"group {i}: window {window} does not fit its kind")
        group = Group(GroupKind(kind), layers, window, first, blocks)
        # A window group holds its whole window or, on a parent that ends where the file
        # starts, the part from parent_tokens on: the file cannot tell which its parent
        # is, so both are sound here (a load asks only for blocks inside the range).
        held = payload.parent_tokens if kind == GroupKind.WINDOW else 0
        if group not in (
            group.placed(payload.parent_tokens, tokens, lay.block_size),
            group.placed(payload.parent_tokens, tokens, lay.block_size, held),
        ):
            raise FormatError(
                f"group {i}: blocks {first}+{blocks} are not the ones its kind holds for this file"
            )
        groups.append(group)
    if sum(g.layers for g in groups) != lay.num_layers:
        raise FormatError("group layer counts do not add up to the layer count")
    if payload.version != PAYLOAD_VERSION_PACKED and has_state(groups) != (
        payload.version == PAYLOAD_VERSION_STATE
    ):
        raise FormatError("payload version 3 if and only if a group holds a state (raw pages)")
    return replace(payload, groups=tuple(groups))


@dataclass(frozen=True, slots=True)
class Summary:
    """What an index needs from a file, read from its first bytes only (start-up scans)."""

    header: Header
    parent_sha1: str | None
    parent_tokens: int
    token_digest: int
    head: int  # xxh3-64 of the u32 LE ids of the first owned block
    ids_at: int  # file offset of the token ids
