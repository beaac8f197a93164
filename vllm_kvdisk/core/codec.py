"""Lossless compression of a checkpoint's pages (payload version 4; spec: docs/FORMAT.md).

A layer's pages are cut into chunks of ``chunk_pages`` consecutive pages (the last one of
a layer may be shorter; no chunk spans two layers), so a partial hit, a delta and a
sliding window read only the chunks they use. Each chunk is split into byte planes, one
per byte of the page dtype (plane ``j`` holds bytes ``j, j + P, j + 2P, ...``): bf16's
high byte (sign and exponent) is nearly constant while its low byte is noise, so planes
compress far better than the interleaved bytes (real bf16 KV of SmolLM2: 1.45x against
1.27x). Each plane is one zstd frame (level 1), or stored raw where zstd saves less than
1/21 of it (ratio under 1.05: fp8 KV, random data), flagged in its length.

Every chunk carries xxh3-64 of its stored bytes (what is on disk: ``kvdisk verify``
checks it before the decoder sees them) and of its decoded bytes (the pages' identity,
per chunk, so a partial read is proven without decoding the rest of the layer; a restore
checks only this one). The chunk table has its own
xxh3-64 in the packing header.

Why zstandard and our own byte split, not python-blosc2 (its SHUFFLE does the same split,
1.44x here): measured on this machine, blosc2 4.15 holds the GIL (decode 1,587 MB/s on one
thread, 1,547 on two), so the read and save threads cannot decode or encode chunks side by
side; zstandard releases it (decode 882 -> 2,296 MB/s, encode 462 -> 919 MB/s on two
threads) and brings no dependency of its own (blosc2 4.15 pulls pydantic, httpx and rich).

Pure: numpy, xxhash and zstandard.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash
import zstandard

from vllm_kvdisk.core.config import COMPRESSION_MODES as MODES
from vllm_kvdisk.core.errors import FormatError

if TYPE_CHECKING:
    from typing_extensions import Buffer

CODEC_PLANES_ZSTD = 1  # the one codec: byte planes, each a zstd frame or raw
PACK_MAGIC = b"KVZC"
# magic, codec, planes, zero, chunk pages, chunk count, stored page bytes, xxh3 of the table
PACK_HEADER = struct.Struct("<4sBBHIIQQ")
# xxh3-64 of the stored bytes, xxh3-64 of the decoded bytes, 4 plane lengths (bit 31: raw)
CHUNK = struct.Struct("<QQ4I")
RAW_PLANE = 1 << 31
MAX_PLANES = 4
CHUNK_TARGET_BYTES = 256 << 10  # decoded bytes of a chunk, rounded down to whole pages
MIN_RATIO = 1.05  # a plane zstd shrinks by less is stored raw
# What a reader accepts (a sparse file can claim any size; memory stays bounded): chunks of
# one page, or of at most MAX_CHUNK_BYTES decoded; at most MAX_CHUNKS in a file (a 32 MiB
# table; 2^20 chunks of 256 KiB are 256 GiB of pages).
MAX_CHUNK_BYTES = 16 << 20
MAX_CHUNKS = 1 << 20
ZSTD_LEVEL = 1
AUTO_PROBE_BYTES = 64 << 20  # auto: page bytes seen before it may give up on compressing
if PACK_HEADER.size != 32 or CHUNK.size != 32:
    raise RuntimeError("struct layout drifted from docs/FORMAT.md")


def chunk_pages_for(page_bytes: int) -> int:
    """Pages per chunk: as many as fit in ``CHUNK_TARGET_BYTES``, at least one."""
    return max(1, CHUNK_TARGET_BYTES // max(1, page_bytes))


def chunk_count(layer_blocks: Sequence[tuple[int, int]], chunk_pages: int) -> int:
    return sum(-(-count // chunk_pages) for _, count in layer_blocks)


@dataclass(frozen=True, slots=True)
class Chunk:
    stored_sum: int
    raw_sum: int
    lengths: tuple[int, ...]  # per plane; RAW_PLANE set: the plane is stored as is

    @property
    def stored(self) -> int:
        return sum(n & ~RAW_PLANE for n in self.lengths)


@dataclass(frozen=True, slots=True)
class Packing:
    """The chunk table of a compressed file and where each chunk lies."""

    planes: int
    chunk_pages: int
    chunks: tuple[Chunk, ...]
    layer_first: tuple[int, ...]  # layer i's chunks are [layer_first[i], layer_first[i + 1])
    chunk_at: tuple[int, ...]  # chunk k's bytes: [chunk_at[k], chunk_at[k + 1]) from the pages

    @property
    def stored_bytes(self) -> int:
        return self.chunk_at[-1]

    @property
    def table_bytes(self) -> int:
        return PACK_HEADER.size + CHUNK.size * len(self.chunks)

    def layer_chunks(self, layer: int) -> range:
        return range(self.layer_first[layer], self.layer_first[layer + 1])

    def pack(self) -> bytes:
        table = b"".join(
            CHUNK.pack(c.stored_sum, c.raw_sum, *c.lengths, *(0,) * (MAX_PLANES - len(c.lengths)))
            for c in self.chunks
        )
        head = PACK_HEADER.pack(
            PACK_MAGIC,
            CODEC_PLANES_ZSTD,
            self.planes,
            0,
            self.chunk_pages,
            len(self.chunks),
            self.stored_bytes,
            xxhash.xxh3_64_intdigest(table),
        )
        return head + table


def _layout(
    chunks: Sequence[Chunk], layer_blocks: Sequence[tuple[int, int]], chunk_pages: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    first = [0]
    for _, count in layer_blocks:
        first.append(first[-1] + -(-count // chunk_pages))
    at = [0]
    for c in chunks:
        at.append(at[-1] + c.stored)
    return tuple(first), tuple(at)


def packing_of(
    chunks: Sequence[Chunk], planes: int, chunk_pages: int, layer_blocks: Sequence[tuple[int, int]]
) -> Packing:
    first, at = _layout(chunks, layer_blocks, chunk_pages)
    if first[-1] != len(chunks):
        raise ValueError(f"{len(chunks)} chunks for layers that need {first[-1]}")
    return Packing(planes, chunk_pages, tuple(chunks), first, at)


def unpack_header(buf: bytes) -> tuple[int, int, int, int, int]:
    """(planes, chunk pages, chunk count, stored bytes, table checksum) of a packing
    header, its fixed fields checked."""
    if len(buf) < PACK_HEADER.size:
        raise FormatError("truncated packing header")
    magic, codec, planes, zero, chunk_pages, count, stored, table_sum = PACK_HEADER.unpack_from(buf)
    if magic != PACK_MAGIC or zero:
        raise FormatError(f"bad packing header magic {magic!r}")
    if codec != CODEC_PLANES_ZSTD:
        raise FormatError(f"unknown page codec {codec}")
    if not 1 <= planes <= MAX_PLANES or chunk_pages < 1:
        raise FormatError(f"bad plane count {planes} or chunk pages {chunk_pages}")
    if count > MAX_CHUNKS:
        raise FormatError(f"chunk count {count} > {MAX_CHUNKS}")
    return planes, chunk_pages, count, stored, table_sum


def unpack_packing(
    head: bytes,
    table: bytes,
    layer_blocks: Sequence[tuple[int, int]],
    page_bytes: int,
    itemsize: int,
) -> Packing:
    """The chunk table, checked: its checksum, one plane per byte of the page dtype, the
    chunk count the layers need, each plane's length within what it decodes to, and the
    stored total. Raises FormatError."""
    planes, chunk_pages, count, stored, table_sum = unpack_header(head)
    if chunk_pages > 1 and chunk_pages * page_bytes > MAX_CHUNK_BYTES:
        raise FormatError(f"chunks of {chunk_pages} pages of {page_bytes} bytes: too large")
    if planes != itemsize:
        raise FormatError(f"{planes} byte planes for a dtype of {itemsize} bytes")
    if count != chunk_count(layer_blocks, chunk_pages) or len(table) != CHUNK.size * count:
        raise FormatError(f"chunk count {count} does not fit the layers' blocks")
    if xxhash.xxh3_64_intdigest(table) != table_sum:
        raise FormatError("checksum mismatch in the chunk table")
    chunks = []
    sizes = [
        min(chunk_pages, n - k) * page_bytes
        for _, n in layer_blocks
        for k in range(0, n, chunk_pages)
    ]
    for i, raw_size in enumerate(sizes):
        stored_sum, raw_sum, *lengths = CHUNK.unpack_from(table, CHUNK.size * i)
        plane = raw_size // planes
        for j, n in enumerate(lengths):
            if j >= planes:
                if n:
                    raise FormatError(f"chunk {i}: length for plane {j} of {planes}")
            elif n & RAW_PLANE:
                if n & ~RAW_PLANE != plane:
                    raise FormatError(f"chunk {i}: raw plane {j} of {n & ~RAW_PLANE} bytes")
            elif not 0 < n < plane:
                raise FormatError(f"chunk {i}: plane {j} of {n} bytes for {plane}")
        chunks.append(Chunk(stored_sum, raw_sum, tuple(lengths[:planes])))
    packing = packing_of(chunks, planes, chunk_pages, layer_blocks)
    if packing.stored_bytes != stored:
        raise FormatError(f"stored bytes {stored} != the chunks' {packing.stored_bytes}")
    return packing


def chunk_raw_bytes(packing: Packing, layer_pages: int, page_bytes: int, index: int) -> int:
    """Decoded bytes of the ``index``-th chunk of a layer of ``layer_pages`` pages."""
    return min(packing.chunk_pages, layer_pages - index * packing.chunk_pages) * page_bytes


_WORDS: dict[int, np.dtype[Any]] = {
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
}  # planes -> the word they interleave into
_local = threading.local()


def _cctx() -> zstandard.ZstdCompressor:
    ctx = getattr(_local, "cctx", None)
    if ctx is None:  # one per thread: a context is not safe to share
        ctx = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=False)
    return ctx


def _scratch(name: str, size: int) -> np.ndarray:
    """A per-thread byte buffer of ``size`` bytes, reused (fresh memory costs page faults)."""
    buf: np.ndarray | None = getattr(_local, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=np.uint8)
        setattr(_local, name, buf)
    return buf[:size]


def _dctx() -> zstandard.ZstdDecompressor:
    ctx = getattr(_local, "dctx", None)
    if ctx is None:
        ctx = _local.dctx = zstandard.ZstdDecompressor()
    return ctx


def _decompress_into(frame: memoryview, plane: np.ndarray) -> None:
    """Decode one zstd frame into ``plane``, which it must fill exactly.

    Into a reused buffer through a stream reader: ``ZstdDecompressor.decompress`` returns
    fresh bytes, and two threads calling it decoded no faster than one here (2.8 GB/s of
    pages either way) while ``readinto`` scaled to 4.1 (the restore decodes on every reader
    thread)."""
    try:
        with _dctx().stream_reader(frame, closefd=False) as reader:
            got = reader.readinto(plane)
            extra = reader.read(1) if got == plane.size else b""
    except zstandard.ZstdError as exc:
        raise FormatError(f"compressed chunk does not decode: {exc}") from None
    if got != plane.size or extra:
        raise FormatError(
            f"plane decodes to {'more than ' if extra else ''}{got} bytes, not {plane.size}"
        )


def encode_chunk(raw: Buffer, planes: int) -> tuple[Chunk, list[bytes]]:
    """One chunk's planes, each compressed or raw, and its table entry."""
    data = np.frombuffer(memoryview(raw), dtype=np.uint8)
    out: list[bytes] = []
    lengths = []
    stored = xxhash.xxh3_64()
    size = data.size // planes
    words = data.view(_WORDS[planes]) if planes in _WORDS and data.size % planes == 0 else None
    plane = _scratch("plane", size)
    for j in range(planes):
        if planes == 1:
            plane = data
        elif words is not None:  # byte j of each little-endian word, by shifts into a
            # reused buffer: 7.1 GB/s here against 0.47 for a strided copy into new bytes
            if j == 0:
                np.copyto(plane, words, casting="unsafe")
            else:
                shifted = _scratch("words", size * planes)[: size * planes].view(words.dtype)
                np.right_shift(words, 8 * j, out=shifted)
                np.copyto(plane, shifted, casting="unsafe")
        else:
            np.copyto(plane, data[j::planes])
        packed = _cctx().compress(plane.data)
        if len(packed) * MIN_RATIO <= size:
            out.append(packed)
            lengths.append(len(packed))
        else:
            out.append(plane.tobytes())
            lengths.append(size | RAW_PLANE)
        stored.update(out[-1])
    return Chunk(stored.intdigest(), xxhash.xxh3_64_intdigest(raw), tuple(lengths)), out


def decode_chunk(
    stored: memoryview, chunk: Chunk, planes: int, out: memoryview, *, check_stored: bool = True
) -> None:
    """Decode one chunk's stored bytes into ``out`` (exactly its decoded size) and prove
    its checksums; FormatError on any mismatch (``out`` then holds garbage).

    ``check_stored=False`` (a restore) proves only the decoded bytes: they are what the
    engine uses, and a stored byte that changed either fails to decode or changes them
    (zstd's decoder is hardened against arbitrary input, and a raw plane is copied as
    is). It saves hashing the stored bytes: 8.5 of ~100 ms of CPU per 136 MB of bf16
    pages here. ``kvdisk verify`` proves both."""
    if check_stored and xxhash.xxh3_64_intdigest(stored) != chunk.stored_sum:
        raise FormatError("checksum mismatch in a compressed chunk")
    dest = np.frombuffer(out, dtype=np.uint8)
    size = dest.size // planes
    words = dest.view(_WORDS[planes]) if planes in _WORDS and dest.size % planes == 0 else None
    starts = [0]
    for n in chunk.lengths:
        starts.append(starts[-1] + (n & ~RAW_PLANE))
    # The highest byte first, the lowest last: the first plane decoded is shifted
    # straight into the words, the last ORed in from its own bytes (two passes over the
    # output instead of three: 18.6 against 25.4 ms for 136 MB of bf16 here)
    for j in reversed(range(planes)):
        n = chunk.lengths[j]
        piece = stored[starts[j] : starts[j + 1]]
        if n & RAW_PLANE:
            plane = np.frombuffer(piece, dtype=np.uint8)
        else:
            plane = _scratch("decoded", size)
            _decompress_into(piece, plane)
        if plane.size != size:
            raise FormatError(f"plane holds {plane.size} bytes, not {size}")
        if planes == 1:
            dest[:] = plane
        elif words is None:
            dest[j::planes] = plane
        elif j == planes - 1:
            np.left_shift(plane, 8 * j, out=words, dtype=words.dtype)
        elif j == 0:
            np.bitwise_or(words, plane, out=words, casting="unsafe")
        else:
            shifted = _scratch("shifted", dest.size)[: dest.size].view(words.dtype)
            np.left_shift(plane, 8 * j, out=shifted, dtype=words.dtype)
            words |= shifted
    if xxhash.xxh3_64_intdigest(out) != chunk.raw_sum:
        raise FormatError("decoded chunk does not match its checksum")


@dataclass(frozen=True, slots=True)
class Packed:
    """A file's pages, compressed: the table and the stored planes in file order."""

    packing: Packing
    buffers: list[bytes]
    raw_bytes: int


def pack_layers(
    layers: Sequence[Buffer],
    layer_blocks: Sequence[tuple[int, int]],
    page_bytes: int,
    itemsize: int,
) -> Packed:
    """Compress every layer's pages (``layers[i]`` holds layer i's ``layer_blocks[i][1]``
    pages) chunk by chunk."""
    chunk_pages = chunk_pages_for(page_bytes)
    step = chunk_pages * page_bytes
    chunks: list[Chunk] = []
    buffers: list[bytes] = []
    raw = 0
    for buf in layers:
        view = memoryview(buf).cast("B")
        raw += view.nbytes
        for at in range(0, view.nbytes, step):
            chunk, planes = encode_chunk(view[at : at + step], itemsize)
            chunks.append(chunk)
            buffers += planes
    return Packed(packing_of(chunks, itemsize, chunk_pages, layer_blocks), buffers, raw)


AUTO_MIN_CPUS = 8  # auto compresses on hosts with at least this many CPUs (see Choice)


class Choice:
    """Whether the next file is compressed, for ``--kv-disk-compression``: ``off`` never,
    ``zstd`` always, ``auto`` on a host of at least ``AUTO_MIN_CPUS`` CPUs until
    ``AUTO_PROBE_BYTES`` of pages have shown a ratio under ``MIN_RATIO`` (fp8 KV: the
    planes stay raw and encoding them only costs CPU), after which it writes raw files
    for good. Thread-safe.

    Why a CPU count: decoding is what a compressed restore waits for. Measured on a 2-CPU
    VM (benchmarks/compression_bench.py), decoding ran at ~1.2 GB/s of pages on one
    thread and ~1.6 on two, so restores from the page cache took ~4.5x and cold ones from
    the VM's disk (1.5-1.8 GB/s) ~1.15x as long as raw ones, for 0.69 of the bytes on
    bf16; on the same disk throttled to 0.45 GB/s per CPU (an H200 host's 1.8 GB/s NVMe
    for a worker's 4 reader threads) cold ones took 0.73-0.82x. Decoding scales with the
    cores that run it (zstd's Huffman decoding is most of it): 2-3 spare cores keep it
    above the 2.6 GB/s of pages that a 1.8 GB/s NVMe read of 0.69-size files delivers,
    where compression makes cold restores faster and leaves the engine its own cores."""

    def __init__(self, mode: str, cpus: int = AUTO_MIN_CPUS) -> None:
        if mode not in MODES:
            raise ValueError(f"compression {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self.cpus = cpus
        self._raw = self._stored = 0
        self._gave_up = mode == "auto" and cpus < AUTO_MIN_CPUS
        self._lock = threading.Lock()

    def describe(self) -> str:
        """One line for the start-up log: what this choice writes and why."""
        if self.mode != "auto":
            return f"compression {self.mode}"
        if self.cpus < AUTO_MIN_CPUS:
            return (
                f"compression auto: raw files on this host of {self.cpus} CPU(s) (decoding "
                f"would slow restores below {AUTO_MIN_CPUS}; --kv-disk-compression zstd forces it)"
            )
        return "compression auto: zstd while the pages shrink by 1.05x or more"

    def compress(self) -> bool:
        return self.mode == "zstd" or (self.mode == "auto" and not self._gave_up)

    def observe(self, raw: int, stored: int) -> bool:
        """Count one compressed file; True when auto has just given up."""
        with self._lock:
            self._raw += raw
            self._stored += stored
            if (
                self.mode == "auto"
                and not self._gave_up
                and self._raw >= AUTO_PROBE_BYTES
                and self._raw < MIN_RATIO * self._stored
            ):
                self._gave_up = True
                return True
        return False
