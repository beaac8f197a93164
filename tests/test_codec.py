"""Compressed pages (payload version 4): the chunk codec, its file layout, every reader on
compressed files, partial reads, and corruption that is caught, never decoded into pages."""

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synth import FP, LAYOUT, encode, planner, prompt

from vllm_kvdisk.core import codec
from vllm_kvdisk.core.codec import (
    CHUNK,
    PACK_HEADER,
    RAW_PLANE,
    Choice,
    decode_chunk,
    encode_chunk,
)
from vllm_kvdisk.core.encode import encode_checkpoint
from vllm_kvdisk.core.format import (
    PAGE_ALIGN,
    PAYLOAD_VERSION_PACKED,
    FormatError,
    PageLayout,
    Payload,
    Reason,
    UnsupportedFile,
)
from vllm_kvdisk.ops.cli import main
from vllm_kvdisk.storage import pageread
from vllm_kvdisk.storage.fileread import check_layers, read_meta, read_tokens, read_tool_map
from vllm_kvdisk.storage.pageread import read_layer_parts, read_layers_into
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify

GOLDEN = Path(__file__).parent / "golden"
# 2 layers of 3 pages of 4 x 64 float32 (1 KiB): 3 KiB a layer, 256 pages a chunk
PACKED_LAYOUT = PageLayout("cpu:LBHNC", 4, 2, (1, 4, 64), "float32")


def bf16_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """KV-like bf16 bits: normal values, so the high byte (sign, exponent) repeats."""
    return (rng.normal(0, 1, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def golden_pages() -> list[bytes]:
    """Float32 pages whose top bytes repeat and whose low bytes are noise (PCG64 is
    stable across numpy versions)."""
    rng = np.random.default_rng(7)
    return [
        (np.float32(i + 1.5) + rng.normal(0, 0.01, 3 * 256).astype(np.float32))
        .astype("<f4")
        .tobytes()
        for i in range(2)
    ]


def golden_packed() -> bytes:
    tokens = np.arange(16, dtype="<u4")
    payload = Payload(bytes(range(32)), "ab" * 20, 4, 1, 3, PACKED_LAYOUT, 0x0123456789ABCDEF)
    enc = encode_checkpoint(
        text=b"packed pages, delta",
        tokens=tokens.tobytes(),
        layers=golden_pages(),
        payload=payload,
        reason=Reason.CONTINUED,
        kv_dtype="float32",
        context_size=8192,
        now=1_700_000_000,
        tool_map=[("call_1", '{"a": 1}')],
        compress=True,
    )
    return b"".join(bytes(b) for b in enc.buffers)


def write(tmp_path, raw: bytes, name: str = "x.kv") -> int:
    path = tmp_path / name
    path.write_bytes(raw)
    return os.open(path, os.O_RDONLY)


def test_the_golden_compressed_file_reads_back_its_pages(tmp_path):
    """tests/golden/v2_packed_delta_ktm.kv pins the layout for every later build (its
    zstd frames may differ from what another zstd writes today: the layout is what must
    not change, so the file is read, not regenerated)."""
    raw = (GOLDEN / "v2_packed_delta_ktm.kv").read_bytes()
    fd = write(tmp_path, raw)
    meta = read_meta(fd, len(raw))
    assert meta.payload.version == PAYLOAD_VERSION_PACKED == 4
    check_layers(fd, meta)
    assert np.frombuffer(read_tokens(fd, meta), "<u4").tolist() == list(range(16))
    assert read_tool_map(fd, meta) == [("call_1", '{"a": 1}')]
    outs = [memoryview(bytearray(meta.offsets.layer_size(i))) for i in range(2)]
    read_layers_into(fd, meta, 0, outs)
    assert [bytes(o) for o in outs] == golden_pages()
    # The packing header follows the token ids; the pages start page-aligned after it.
    table = meta.offsets.tokens + 4 * 16
    assert meta.offsets.table == table and meta.offsets.pages % PAGE_ALIGN == 0
    magic, codec_id, planes, zero, chunk_pages, count, stored, _ = PACK_HEADER.unpack_from(
        raw, table
    )
    assert (magic, codec_id, planes, zero, chunk_pages, count) == (b"KVZC", 1, 4, 0, 256, 2)
    assert stored == meta.offsets.stored_bytes < meta.offsets.raw_bytes == 2 * 3 * 1024
    lengths = [CHUNK.unpack_from(raw, table + 32 + 32 * k)[2:] for k in range(2)]
    flags = {bool(n & RAW_PLANE) for chunk in lengths for n in chunk}
    assert flags == {True, False}  # top planes compressed, the noisy low plane raw
    os.close(fd)


def test_the_golden_compressed_file_is_what_the_encoder_lays_out():
    """Everything up to the compressed bytes is pinned byte for byte."""
    raw = (GOLDEN / "v2_packed_delta_ktm.kv").read_bytes()
    now = golden_packed()
    (text_len,) = struct.unpack_from("<I", raw, 48)
    tokens_end = 52 + text_len + 160 + 16 + 8 * 3 + 4 * 16
    assert now[:tokens_end] == raw[:tokens_end]
    assert now[tokens_end : tokens_end + 8] == raw[tokens_end : tokens_end + 8]  # magic..


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(["bf16", "f32", "u8", "noise"]),
    pages=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_chunks_round_trip_byte_for_byte(dtype, pages, seed):
    rng = np.random.default_rng(seed)
    n = pages * 96
    if dtype == "bf16":
        data, planes = bf16_like(rng, n).tobytes(), 2
    elif dtype == "f32":
        data, planes = rng.normal(0, 1, n).astype("<f4").tobytes(), 4
    elif dtype == "u8":
        data, planes = rng.integers(0, 4, n, dtype=np.uint8).tobytes(), 1
    else:
        data, planes = rng.integers(0, 256, 4 * n, dtype=np.uint8).tobytes(), 2
    chunk, stored = encode_chunk(data, planes)
    out = bytearray(len(data))
    decode_chunk(memoryview(b"".join(stored)), chunk, planes, memoryview(out))
    assert bytes(out) == data
    if dtype == "noise":  # nothing to gain: every plane stored as is
        assert all(length & RAW_PLANE for length in chunk.lengths)


def test_kv_like_bf16_takes_at_most_three_quarters_of_its_bytes():
    data = bf16_like(np.random.default_rng(0), 1 << 18).tobytes()
    chunk, _ = encode_chunk(data, 2)
    assert chunk.stored <= 0.75 * len(data)
    assert not chunk.lengths[1] & RAW_PLANE  # the high byte compresses


def compressed_file(tmp_path, layers: int = 3, pages: int = 40):
    lay = PageLayout("cpu:LBHNC", 16, layers, (2, 4, 16, 64), "bfloat16")
    rng = np.random.default_rng(1)
    data = [bf16_like(rng, pages * lay.page_bytes // 2).tobytes() for _ in range(layers)]
    enc = encode_checkpoint(
        text=b"x" * 100,
        tokens=np.arange(pages * 16, dtype="<u4").tobytes(),
        layers=data,
        payload=Payload(bytes(32), None, 0, 0, pages, lay, 1),
        reason=Reason.COLD,
        kv_dtype="bfloat16",
        context_size=1,
        now=1,
        compress=True,
    )
    raw = b"".join(bytes(b) for b in enc.buffers)
    assert len(raw) == enc.size and enc.stored_page_bytes < 0.75 * enc.raw_page_bytes
    return raw, data, lay


def test_a_partial_read_reads_only_the_chunks_of_the_pages_it_uses(tmp_path, monkeypatch):
    raw, data, lay = compressed_file(tmp_path)
    fd = write(tmp_path, raw)
    meta = read_meta(fd, len(raw))
    packing = meta.payload.packing
    assert packing.chunk_pages == 16 and len(packing.layer_chunks(1)) == 3
    read_bytes = []
    real = os.preadv

    def counting(fd_, views, at, *flags):
        read_bytes.append(sum(memoryview(v).nbytes for v in views))
        return real(fd_, views, at, *flags)

    monkeypatch.setattr(pageread.os, "preadv", counting)
    pb = lay.page_bytes
    used = memoryview(bytearray(7 * pb))
    # pages 17..23 of layer 1 (in its chunk 1 only), into two buffers
    parts = [(17 * pb, None), (7 * pb, [used[: 2 * pb], used[2 * pb :]]), (16 * pb, None)]
    read_layer_parts(fd, meta, 1, parts, memoryview(bytearray(0)))
    assert bytes(used) == data[1][17 * pb : 24 * pb]
    k = packing.layer_first[1] + 1
    assert sum(read_bytes) == packing.chunks[k].stored
    os.close(fd)


def test_whole_layers_read_into_runs_of_blocks(tmp_path):
    raw, data, lay = compressed_file(tmp_path)
    fd = write(tmp_path, raw)
    meta = read_meta(fd, len(raw))
    pb = lay.page_bytes
    outs = []
    for _ in range(3):  # runs of 3, 20 and 17 pages: chunks straddle the runs
        buf = memoryview(bytearray(40 * pb))
        outs.append((buf, [buf[: 3 * pb], buf[3 * pb : 23 * pb], buf[23 * pb :]]))
    read_layers_into(fd, meta, 0, [views for _, views in outs])
    assert [bytes(buf) for buf, _ in outs] == data
    os.close(fd)


def flip_at(raw: bytes, at: int) -> bytes:
    bad = bytearray(raw)
    bad[at] ^= 0x40
    return bytes(bad)


@pytest.mark.parametrize("where", ["compressed plane", "raw plane", "table", "pack header"])
def test_a_flipped_byte_is_corrupt_never_pages(tmp_path, where):
    raw, data, lay = compressed_file(tmp_path)
    meta = read_meta(write(tmp_path, raw), len(raw))
    packing = meta.payload.packing
    base = meta.offsets.pages
    k = 2
    chunk = packing.chunks[k]
    raw_plane = [j for j, n in enumerate(chunk.lengths) if n & RAW_PLANE]
    if where == "compressed plane":
        at = base + packing.chunk_at[k] + 3 + (chunk.lengths[0] & ~RAW_PLANE if raw_plane else 0)
    elif where == "raw plane":
        assert raw_plane == [0]  # bf16's low byte: noise
        at = base + packing.chunk_at[k] + 5
    elif where == "table":
        at = meta.offsets.table + PACK_HEADER.size + CHUNK.size * k + 17
    else:
        at = meta.offsets.table + 8  # chunk pages
    bad = flip_at(raw, at)
    fd = write(tmp_path, bad, "bad.kv")
    with pytest.raises(FormatError) as err:
        m = read_meta(fd, len(bad))
        outs = [memoryview(bytearray(m.offsets.layer_size(i))) for i in range(3)]
        read_layers_into(fd, m, 0, outs)
    assert not isinstance(err.value, UnsupportedFile)
    with pytest.raises(FormatError):
        check_layers(fd, read_meta(fd, len(bad))) if where.endswith("plane") else None
        raise FormatError("read_meta refused it")
    os.close(fd)


def test_a_restore_proves_the_decoded_bytes_and_verify_the_stored_ones_too(tmp_path):
    """A restore checks what the engine uses, the decoded chunk, and not the stored
    bytes' checksum (one hash less per chunk; a changed stored byte is caught by the
    decoder or the decoded checksum, as the flipped-byte tests show). A table whose
    stored checksum lies (the table's own checksum made to agree) restores the right
    pages, and verify still calls the file corrupt."""
    raw, data, lay = compressed_file(tmp_path)
    meta = read_meta(write(tmp_path, raw), len(raw))
    table = meta.offsets.table + PACK_HEADER.size
    count = len(meta.payload.packing.chunks)
    bad = bytearray(raw)
    struct.pack_into(
        "<Q", bad, table + CHUNK.size * 2, meta.payload.packing.chunks[2].stored_sum ^ 1
    )
    struct.pack_into(
        "<Q",
        bad,
        table - 8,
        xxhash.xxh3_64_intdigest(bytes(bad[table : table + CHUNK.size * count])),
    )
    fd = write(tmp_path, bytes(bad), "lying.kv")
    m = read_meta(fd, len(bad))
    outs = [memoryview(bytearray(m.offsets.layer_size(i))) for i in range(3)]
    read_layers_into(fd, m, 0, outs)
    assert [bytes(o) for o in outs] == data
    with pytest.raises(FormatError, match="checksum mismatch in a compressed chunk"):
        check_layers(fd, m)
    os.close(fd)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(at=st.integers(0, 1 << 30), bit=st.integers(0, 7))
def test_any_flipped_bit_is_caught_or_harmless(tmp_path, at, bit):
    raw, data, lay = compressed_file(tmp_path, layers=2, pages=12)
    at %= len(raw)
    bad = bytearray(raw)
    bad[at] ^= 1 << bit
    fd = write(tmp_path, bytes(bad), "fuzz.kv")
    try:
        meta = read_meta(fd, len(bad))
        outs = [memoryview(bytearray(meta.offsets.layer_size(i))) for i in range(2)]
        read_layers_into(fd, meta, 0, outs)
    except FormatError:
        return
    finally:
        os.close(fd)
    assert [bytes(o) for o in outs] == data  # a mutable or unchecked field: same pages


def test_kvdisk_verify_catches_a_flipped_byte_in_a_compressed_chunk(tmp_path, capsys):
    store = Store(str(tmp_path / "kv"), space_bytes=1 << 30)
    ns = store.ensure_namespace(FP)
    p = prompt(3, 200)
    plan = planner(store).plan_save(ns, p, 128, Reason.COLD)
    nb = plan.tokens // LAYOUT.block_size
    rng = np.random.default_rng(5)
    layers = [
        rng.normal(0, 1, nb * LAYOUT.page_bytes // 4).astype("<f4").tobytes()
        for _ in range(LAYOUT.num_layers)
    ]
    enc = encode(plan, p, layers, now=1, compress=True)
    store.write(ns, plan.sha1, enc)
    assert verify(Store(str(tmp_path / "kv"), space_bytes=1 << 30, readonly=True)).problems == []
    code = main(["ls", str(tmp_path / "kv"), "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and rows[0]["stored_page_bytes"] == enc.stored_page_bytes
    assert rows[0]["raw_page_bytes"] == enc.raw_page_bytes > enc.stored_page_bytes
    path = store.path(ns, plan.sha1)
    meta = enc.offsets
    k = enc.payload.packing.chunks
    flip = meta.pages + enc.payload.packing.chunk_at[1] + (k[1].stored // 2)
    Path(path).write_bytes(flip_at(Path(path).read_bytes(), flip))
    report = verify(Store(str(tmp_path / "kv"), space_bytes=1 << 30, readonly=True))
    assert [p.kind for p in report.problems] == ["bad"]
    assert "chunk" in report.problems[0].detail


def test_auto_writes_raw_files_on_a_small_host():
    assert not Choice("auto", cpus=2).compress() and Choice("zstd", cpus=2).compress()
    assert Choice("auto", cpus=codec.AUTO_MIN_CPUS).compress()
    assert "raw files" in Choice("auto", cpus=2).describe()


def test_auto_gives_up_on_pages_that_do_not_shrink_and_zstd_never_does():
    auto, always, off = Choice("auto", 64), Choice("zstd", 64), Choice("off", 64)
    assert auto.compress() and always.compress() and not off.compress()
    step = 8 << 20
    for _ in range(codec.AUTO_PROBE_BYTES // step - 1):  # fp8-like: 1.01x
        assert not auto.observe(step, int(step / 1.01))
        always.observe(step, int(step / 1.01))
    assert auto.compress()  # not yet 64 MiB seen
    assert auto.observe(step, int(step / 1.01))
    assert not auto.compress() and always.compress()
    kv = Choice("auto", 64)
    kv.observe(1 << 30, 700 << 20)  # bf16 KV: 1.46x
    assert kv.compress()
    with pytest.raises(ValueError):
        Choice("lz4")


def test_the_stored_checksum_is_over_the_bytes_on_disk():
    data = bf16_like(np.random.default_rng(2), 4096).tobytes()
    chunk, stored = encode_chunk(data, 2)
    assert chunk.stored_sum == xxhash.xxh3_64_intdigest(b"".join(stored))
    assert chunk.raw_sum == xxhash.xxh3_64_intdigest(data)


@pytest.mark.parametrize(
    "field,value,why",
    [(8, 1 << 20, "too large"), (12, (1 << 20) + 1, "chunk count")],
)
def test_a_table_claiming_huge_chunks_or_counts_is_refused_before_any_allocation(
    tmp_path, field, value, why
):
    """A sparse file may claim any size: chunks past 16 MiB decoded (unless one page) and
    tables past 2^20 chunks are corrupt, so a reader's memory stays bounded."""
    raw, _, _ = compressed_file(tmp_path)
    meta = read_meta(write(tmp_path, raw), len(raw))
    bad = bytearray(raw)
    struct.pack_into("<I", bad, meta.offsets.table + field, value)
    with pytest.raises(FormatError, match=why):
        read_meta(write(tmp_path, bytes(bad), "huge.kv"), len(bad))


@pytest.mark.parametrize("delta", [-1, 1, 4096])
def test_a_plane_that_decodes_to_another_length_is_corrupt(delta):
    """A frame whose checksums agree (a writer that lied, or a crafted file) but which
    decodes to fewer or more bytes than its plane holds is refused, never written past the
    plane (the decoder fills a reused buffer of exactly the plane's size)."""
    import zstandard

    data = bf16_like(np.random.default_rng(3), 4096).tobytes()
    size = len(data) // 2
    low, high_plane = data[0::2], data[1::2]
    plane = high_plane[:delta] if delta < 0 else high_plane + b"\0" * delta
    high = zstandard.ZstdCompressor(level=1).compress(plane)
    stored = low + high
    chunk = codec.Chunk(
        xxhash.xxh3_64_intdigest(stored),
        xxhash.xxh3_64_intdigest(data),
        (size | codec.RAW_PLANE, len(high), 0, 0),
    )
    out = bytearray(len(data))
    with pytest.raises(FormatError, match="decode"):
        decode_chunk(memoryview(stored), chunk, 2, memoryview(out))
