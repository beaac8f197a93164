"""The .kv codec: golden bytes, round trips, limits, and corruption that never crashes."""

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_kvdisk.core.encode import encode_checkpoint
from vllm_kvdisk.core.format import (
    FLAG_DELTA,
    FLAG_TOOL_MAP,
    PAGE_ALIGN,
    FormatError,
    Group,
    GroupKind,
    PageLayout,
    Payload,
    Reason,
    UnsupportedFile,
)
from vllm_kvdisk.core.toolmap import decode_tool_map, encode_tool_map
from vllm_kvdisk.storage.fileread import (
    read_meta,
    read_text,
    read_tokens,
    read_tool_map,
)
from vllm_kvdisk.storage.pageread import read_layer_into

GOLDEN = Path(__file__).parent / "golden"
LAYOUT = PageLayout("cpu:LBHNC", 4, 2, (1, 4, 2), "float32")


# A hybrid file: layer 0 full attention (the owned block), layer 1 a sliding window of 6
# tokens (a hit at 8 needs tokens 3..7: blocks 0 and 1; block 0 only if the parent, which
# then ends at 4, does not hold it: ``held``).
HYBRID = (Group(GroupKind.FULL, 1), Group(GroupKind.WINDOW, 1, window=6))


def golden_checkpoint(delta: bool, hybrid: bool = False, held: bool = False) -> bytes:
    """A tiny, fully deterministic checkpoint; its bytes are pinned in tests/golden/."""
    tokens = np.arange(8 if delta else 4, dtype="<u4")
    first = 1 if delta else 0
    nb = 1
    per_layer = [nb, 1 if held else 2 if hybrid else nb]
    layers = [np.full((per_layer[i], 1, 4, 2), i + 0.5, dtype="<f4").tobytes() for i in range(2)]
    payload = Payload(
        bytes(range(32)),
        ("ab" * 20) if delta else None,
        4 if delta else 0,
        first,
        nb,
        LAYOUT,
        0x0123456789ABCDEF,
        **({"groups": HYBRID} if hybrid else {}),
    )
    enc = encode_checkpoint(
        text="héllo wörld"[: 8 if delta else 4].encode(),
        tokens=tokens.tobytes(),
        layers=layers,
        payload=payload,
        reason=Reason.CONTINUED if delta else Reason.COLD,
        kv_dtype="float32",
        context_size=8192,
        now=1_700_000_000,
        tool_map=[("call_1", '{"a": 1}')] if delta else (),
        window_held=4 if held else 0,
    )
    return b"".join(bytes(b) for b in enc.buffers)


@pytest.mark.parametrize(
    "name,delta,hybrid,held",
    [
        ("v2_root.kv", False, False, False),
        ("v2_delta_ktm.kv", True, False, False),
        ("v2_hybrid_delta_ktm.kv", True, True, False),
        ("v2_hybrid_held_delta_ktm.kv", True, True, True),
    ],
)
def test_golden_files_pin_the_layout(name, delta, hybrid, held):
    assert golden_checkpoint(delta, hybrid, held) == (GOLDEN / name).read_bytes()


@pytest.mark.parametrize("name", ["v1_root.kv", "v1_delta_ktm.kv"])
def test_previous_version_files_are_unsupported_not_corrupt(tmp_path, name):
    """Version 1 files are left alone (a miss), never quarantined as corrupt."""
    raw = (GOLDEN / name).read_bytes()
    with pytest.raises(UnsupportedFile, match="format version 1"):
        read_meta(write(tmp_path, raw), len(raw))


def test_golden_group_table_by_offset(tmp_path):
    raw = (GOLDEN / "v2_hybrid_delta_ktm.kv").read_bytes()
    (text_len,) = struct.unpack_from("<I", raw, 48)
    payload = 52 + text_len
    assert struct.unpack_from("<H", raw, payload + 94)[0] == 2  # group count
    # kind, zero, layers, window, first block, block count
    assert struct.unpack_from("<BBHIII", raw, payload + 160) == (1, 0, 1, 0, 1, 1)
    assert struct.unpack_from("<BBHIII", raw, payload + 176) == (2, 0, 1, 6, 0, 2)
    meta = read_meta(write(tmp_path, raw), len(raw))
    assert meta.payload.groups == (
        Group(GroupKind.FULL, 1, 0, 1, 1),
        Group(GroupKind.WINDOW, 1, 6, 0, 2),
    )
    page = LAYOUT.page_bytes
    assert [meta.offsets.layer_size(i) for i in range(2)] == [page, 2 * page]
    window = bytearray(2 * page)
    read_layer_into(write(tmp_path, raw), meta, 1, memoryview(window))
    assert bytes(window) == np.full((2, 1, 4, 2), 1.5, dtype="<f4").tobytes()


def test_a_window_group_may_leave_the_blocks_below_its_parent_to_it(tmp_path):
    """A delta on a parent that ends where it starts stores its window from parent_tokens
    on (block 1 of the window 0..1): read back as that range, its one page intact; the
    encoder refuses any other part left out."""
    raw = (GOLDEN / "v2_hybrid_held_delta_ktm.kv").read_bytes()
    meta = read_meta(write(tmp_path, raw), len(raw))
    assert meta.payload.groups == (
        Group(GroupKind.FULL, 1, 0, 1, 1),
        Group(GroupKind.WINDOW, 1, 6, 1, 1),
    )
    window = bytearray(LAYOUT.page_bytes)
    read_layer_into(write(tmp_path, raw), meta, 1, memoryview(window))
    assert bytes(window) == np.full((1, 1, 4, 2), 1.5, dtype="<f4").tobytes()
    assert len(raw) < len((GOLDEN / "v2_hybrid_delta_ktm.kv").read_bytes())
    with pytest.raises(FormatError, match="window groups held below 8"):
        encode_checkpoint(
            text=b"x" * 8,
            tokens=np.arange(8, dtype="<u4").tobytes(),
            layers=[bytes(LAYOUT.page_bytes)] * 2,
            payload=Payload(bytes(32), "ab" * 20, 4, 1, 1, LAYOUT, 0, groups=HYBRID),
            reason=Reason.COLD,
            kv_dtype="float32",
            context_size=8192,
            now=0,
            window_held=8,
        )


def test_group_ranges_are_checked(tmp_path):
    """A group table whose block range is not what its kind holds for the file, or whose
    layer counts do not add up, is corrupt."""
    raw = bytearray(golden_checkpoint(True, hybrid=True))
    (text_len,) = struct.unpack_from("<I", raw, 48)
    at = 52 + text_len + 176
    for field, value in ((4, 3), (8, 1), (12, 1), (2, 2), (0, 3)):
        bad = bytearray(raw)
        if field == 2:
            struct.pack_into("<H", bad, at + 2, value)
        elif field == 0:
            bad[at] = value
        else:
            struct.pack_into("<I", bad, at + field, value)
        with pytest.raises(FormatError) as err:
            read_meta(write(tmp_path, bytes(bad)), len(bad))
        assert not isinstance(err.value, UnsupportedFile)


def test_encoder_refuses_layers_of_the_wrong_group_size():
    with pytest.raises(FormatError, match="layer 1 buffer"):
        layers = [bytes(LAYOUT.page_bytes)] * 2  # the window layer needs two pages
        encode_checkpoint(
            text=b"abcdefgh",
            tokens=np.arange(8, dtype="<u4").tobytes(),
            layers=layers,
            payload=Payload(bytes(32), "ab" * 20, 4, 1, 1, LAYOUT, 0, groups=HYBRID),
            reason=Reason.COLD,
            kv_dtype="float32",
            context_size=8,
            now=0,
        )


def test_golden_header_fields_by_offset():
    raw = (GOLDEN / "v2_delta_ktm.kv").read_bytes()
    assert raw[0:3] == b"KVC" and raw[3] == 2  # magic, version
    assert raw[4] == 1  # KV dtype code: float32
    assert raw[5] == 2  # save reason: continued
    assert struct.unpack_from("<H", raw, 6)[0] == FLAG_TOOL_MAP | FLAG_DELTA
    assert struct.unpack_from("<IIQQQQ", raw, 8) == (
        8,
        0,
        8192,
        1_700_000_000,
        1_700_000_000,
        struct.unpack_from("<Q", raw, 40)[0],
    )
    (text_len,) = struct.unpack_from("<I", raw, 48)
    assert raw[52 : 52 + text_len].decode() == "héllo wö"
    payload = 52 + text_len
    assert raw[payload : payload + 4] == b"KVDP"
    assert raw[-len(encode_tool_map([("call_1", '{"a": 1}')])) :] == encode_tool_map(
        [("call_1", '{"a": 1}')]
    )


def write(tmp_path, raw: bytes) -> int:
    path = tmp_path / "x.kv"
    path.write_bytes(raw)
    return os.open(path, os.O_RDONLY)


def test_round_trip(tmp_path):
    raw = golden_checkpoint(True)
    fd = write(tmp_path, raw)
    meta = read_meta(fd, len(raw))
    assert meta.header.tokens == 8 and meta.payload.parent_sha1 == "ab" * 20
    assert meta.offsets.pages % PAGE_ALIGN == 0
    assert read_text(fd, meta) == "héllo wörld".encode()[: len(read_text(fd, meta))]
    assert np.frombuffer(read_tokens(fd, meta), "<u4").tolist() == list(range(8))
    for layer in range(2):
        out = bytearray(meta.offsets.layer_bytes)
        read_layer_into(fd, meta, layer, memoryview(out))
        assert np.frombuffer(out, "<f4").tolist() == [layer + 0.5] * 8
    assert read_tool_map(fd, meta) == [("call_1", '{"a": 1}')]
    os.close(fd)


def test_layers_read_into_split_buffers_survive_short_reads(tmp_path, monkeypatch):
    """Each layer in one call (then hashed while its bytes are in the CPU's caches), into
    three pieces (as runs of blocks would be); the kernel may return fewer bytes than
    asked (here: at most 5 per call)."""
    import vllm_kvdisk.storage.fileread as fmt
    import vllm_kvdisk.storage.pageread as pages

    raw = golden_checkpoint(True)
    fd = write(tmp_path, raw)
    meta = read_meta(fd, len(raw))
    real = os.preadv
    calls = []

    def short(fd_, views, at, *flags):
        calls.append(len(views))
        budget, cut = 5, []
        for v in views:
            cut.append(v[:budget])
            budget -= len(cut[-1])
            if not budget:
                break
        return real(fd_, cut, at, *flags)

    monkeypatch.setattr(fmt.os, "preadv", short)
    bufs = [[memoryview(bytearray(n)) for n in (3, 16, 13)] for _ in range(2)]
    pages.read_layers_into(fd, meta, 0, bufs)
    for layer, views in enumerate(bufs):
        assert np.frombuffer(b"".join(bytes(v) for v in views), "<f4").tolist() == [layer + 0.5] * 8
    assert len(calls) == 2 * (32 // 5 + 1) and calls[0] == 3  # a layer's pieces at once
    with pytest.raises(ValueError):
        pages.read_layers_into(fd, meta, 1, bufs)  # layer 2 does not exist
    with pytest.raises(ValueError):
        pages.read_layers_into(fd, meta, 0, [[memoryview(bytearray(31))]])
    os.close(fd)


def test_layers_are_read_and_hashed_a_cache_sized_piece_at_a_time(tmp_path, monkeypatch):
    """A layer is read and hashed ``HOT_BYTES`` at a time (each piece hashed while it is in
    the CPU's caches); pieces cross the buffers' edges anywhere, the bytes and the checksum
    are those of the whole layer, and a flipped byte is still found."""
    import vllm_kvdisk.storage.fileread as fmt
    import vllm_kvdisk.storage.pageread as pages

    monkeypatch.setattr(pages, "HOT_BYTES", 7)
    raw = golden_checkpoint(True)
    fd = write(tmp_path, raw)
    meta = read_meta(fd, len(raw))
    reads = []
    real = os.preadv
    monkeypatch.setattr(
        fmt.os,
        "preadv",
        lambda f, views, at, *fl: (
            reads.append(sum(v.nbytes for v in views)),
            real(f, views, at, *fl),
        )[1],
    )
    bufs = [[memoryview(bytearray(n)) for n in (3, 0, 16, 13)] for _ in range(2)]
    pages.read_layers_into(fd, meta, 0, bufs)
    for layer, views in enumerate(bufs):
        assert np.frombuffer(b"".join(bytes(v) for v in views), "<f4").tolist() == [layer + 0.5] * 8
    assert max(reads) == 7 and sum(reads) == 64
    kept = memoryview(bytearray(12))
    pages.read_layer_parts(fd, meta, 1, [(20, None), (12, [kept])], memoryview(bytearray(9)))
    assert np.frombuffer(bytes(kept), "<f4").tolist() == [1.5] * 3
    os.close(fd)
    flipped = bytearray(raw)
    flipped[meta.offsets.layer(1) + 10] ^= 1
    fd = write(tmp_path, bytes(flipped))
    with pytest.raises(FormatError):
        pages.read_layers_into(fd, meta, 1, [[memoryview(bytearray(32))]])
    with pytest.raises(FormatError):
        pages.read_layer_parts(fd, meta, 1, [(32, None)], memoryview(bytearray(5)))
    os.close(fd)


def test_logits_flag_and_future_versions_are_unsupported(tmp_path):
    raw = bytearray(golden_checkpoint(False))
    raw[6] |= 4
    fd = write(tmp_path, bytes(raw))
    with pytest.raises(UnsupportedFile, match="logits"):
        read_meta(fd, len(raw))
    raw = bytearray(golden_checkpoint(False))
    raw[3] = 9
    fd = write(tmp_path, bytes(raw))
    with pytest.raises(UnsupportedFile, match="version 9"):
        read_meta(fd, len(raw))


def test_hostile_lengths_are_rejected_before_allocation(tmp_path):
    raw = bytearray(golden_checkpoint(False))
    struct.pack_into("<I", raw, 48, 0xFFFFFFF0)  # text length far beyond the file
    fd = write(tmp_path, bytes(raw))
    with pytest.raises(FormatError, match="text length"):
        read_meta(fd, len(raw))
    with pytest.raises(FormatError, match="entries"):
        decode_tool_map(b"KTM\x01" + struct.pack("<I", 1 << 30))
    with pytest.raises(FormatError, match="limits"):
        decode_tool_map(b"KTM\x01" + struct.pack("<III", 1, 1, 1 << 31) + b"x")


def test_tool_map_round_trip_and_limits():
    entries = [("call_ü", '<tool_call>{"x": "日本"}</tool_call>'), ("id2", "")]
    assert decode_tool_map(encode_tool_map(entries)) == entries
    with pytest.raises(FormatError):
        encode_tool_map([("", "x")])
    with pytest.raises(FormatError, match="trailing"):
        decode_tool_map(encode_tool_map(entries) + b"\0")


def test_encoder_rejects_wrong_layer_sizes():
    payload = Payload(bytes(32), None, 0, 0, 1, LAYOUT, 0)
    with pytest.raises(FormatError, match="layer 0 buffer"):
        encode_checkpoint(
            text=b"abcd",
            tokens=bytes(16),
            layers=[b"x" * 8, b"x" * 32],
            payload=payload,
            reason=Reason.COLD,
            kv_dtype="float32",
            context_size=1,
            now=0,
        )


def parse_all(fd: int, size: int) -> list[bytes]:
    meta = read_meta(fd, size)
    out = [read_text(fd, meta), read_tokens(fd, meta)]
    for layer in range(meta.payload.layout.num_layers):
        buf = bytearray(meta.offsets.layer_bytes)
        read_layer_into(fd, meta, layer, memoryview(buf))
        out.append(bytes(buf))
    out.append(repr(read_tool_map(fd, meta)).encode())
    return out


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_truncation_and_bit_flips_never_crash_or_return_wrong_pages(tmp_path, data):
    raw = golden_checkpoint(True)
    fd0 = write(tmp_path, raw)
    good = parse_all(fd0, len(raw))
    os.close(fd0)
    mutated = bytearray(raw)
    if data.draw(st.booleans()):
        mutated = mutated[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            pos = data.draw(st.integers(0, len(raw) - 1))
            mutated[pos] ^= 1 << data.draw(st.integers(0, 7))
    fd = write(tmp_path, bytes(mutated))
    try:
        got = parse_all(fd, len(mutated))
    except FormatError:
        return  # rejected: the only acceptable failure
    finally:
        os.close(fd)
    # Accepted: only the save reason, the mutable statistics (hit count, times, context
    # size), the zero padding or the text (checked against the file name by the store) may
    # differ; pages, tokens and the tool map are exactly the originals.
    assert got[1:] == good[1:]
    changed = [i for i in range(len(raw)) if i < len(mutated) and raw[i] != mutated[i]]
    assert len(mutated) == len(raw)
    text_end = 52 + len(good[0])
    meta_fd = write(tmp_path, raw)
    offsets = read_meta(meta_fd, len(raw)).offsets
    os.close(meta_fd)
    padding = range(offsets.tokens + 4 * 8, offsets.pages)  # zero padding, not checksummed
    assert all(i == 5 or 12 <= i < 40 or 52 <= i < text_end or i in padding for i in changed), (
        changed
    )


def test_summary_reads_the_walk_key_in_at_most_two_reads(tmp_path, monkeypatch):
    """A start-up scan indexes a file from its first page, plus one read of the payload
    header, checksum table and token ids when the text is longer than a page."""
    from vllm_kvdisk.core.encode import summary_of
    from vllm_kvdisk.core.entry import head_digest
    from vllm_kvdisk.storage import fileread as fmt

    layout = PageLayout("cpu:LBHNC", 4, 2, (1, 4, 2), "float32")
    ids = np.arange(4000, 4012, dtype="<u4")
    layers = [np.zeros((2, 1, 4, 2), "<f4").tobytes() for _ in range(2)]
    for text in (b"short", b"x" * 10000):
        payload = Payload(bytes(32), "ab" * 20, 4, 1, 2, layout, 7)
        enc = encode_checkpoint(
            text=text,
            tokens=ids.tobytes(),
            layers=layers,
            payload=payload,
            reason=Reason.EVICT,
            kv_dtype="float32",
            context_size=1,
            now=0,
        )
        raw = b"".join(bytes(b) for b in enc.buffers)
        fd = write(tmp_path, raw)
        calls = []
        real = os.pread
        monkeypatch.setattr(
            fmt.os, "pread", lambda *a, calls=calls, real=real: calls.append(a) or real(*a)
        )
        sm = fmt.read_summary(fd, len(raw))
        monkeypatch.setattr(fmt.os, "pread", real)
        assert len(calls) == (1 if len(text) < 100 else 2)
        assert sm.head == head_digest(ids, 4, 4) == enc.head
        assert sm == summary_of(enc)
        assert raw[sm.ids_at : sm.ids_at + 48] == ids.tobytes()
        os.close(fd)


def test_a_huge_or_sparse_tool_map_is_rejected_before_it_is_read(tmp_path, monkeypatch):
    raw = golden_checkpoint(True)
    path = tmp_path / "sparse.kv"
    path.write_bytes(raw)
    with open(path, "r+b") as fh:
        fh.truncate(len(raw) + (64 << 30))  # a 64 GiB hole where the tool map would be
    fd = os.open(path, os.O_RDONLY)
    asked: list[int] = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: asked.append(n) or real(fd, n, at))
    try:
        with pytest.raises(FormatError, match="tool map of"):
            read_meta(fd, os.fstat(fd).st_size)
    finally:
        monkeypatch.setattr(os, "pread", real)
        os.close(fd)
    assert sum(asked) <= len(raw)  # the sections before the map, never the map


def test_summary_of_a_delta_whose_first_block_is_past_the_first_page(tmp_path):
    """A short text but a deep parent: the head is read on its own, the digest is kept."""
    from vllm_kvdisk.core.encode import summary_of
    from vllm_kvdisk.storage.fileread import read_summary

    layout = PageLayout("cpu:LBHNC", 16, 1, (1, 16, 1), "float32")
    ids = np.arange(2048, dtype="<u4")  # ids of a 2048-token prefix: 8 KiB, past 4 KiB
    payload = Payload(bytes(32), "cd" * 20, 2032, 127, 1, layout, 99)
    enc = encode_checkpoint(
        text=b"tiny",
        tokens=ids.tobytes(),
        layers=[bytes(64)],
        payload=payload,
        reason=Reason.EVICT,
        kv_dtype="float32",
        context_size=1,
        now=0,
    )
    raw = b"".join(bytes(b) for b in enc.buffers)
    fd = write(tmp_path, raw)
    try:
        assert read_summary(fd, len(raw)) == summary_of(enc)
    finally:
        os.close(fd)


def test_summary_of_a_long_root_reads_its_first_block_not_every_id(tmp_path, monkeypatch):
    """The index needs the first owned block's ids (the head); a scan of a 131k-token
    root past the first page used to read all 512 KiB of its ids."""
    from vllm_kvdisk.core.encode import summary_of
    from vllm_kvdisk.storage.fileread import read_summary

    layout = PageLayout("cpu:LBHNC", 16, 1, (1, 16, 1), "float32")
    ids = np.arange(131072, dtype="<u4")
    payload = Payload(bytes(32), None, 0, 0, 131072 // 16, layout, 99)
    enc = encode_checkpoint(
        text=b"x" * 5000,
        tokens=ids.tobytes(),
        layers=[bytes(64 * (131072 // 16))],
        payload=payload,
        reason=Reason.EVICT,
        kv_dtype="float32",
        context_size=1,
        now=0,
    )
    raw = b"".join(bytes(b) for b in enc.buffers)
    fd = write(tmp_path, raw)
    asked = []
    real = os.pread

    def pread(fd_, size, offset):
        asked.append(size)
        return real(fd_, size, offset)

    monkeypatch.setattr(os, "pread", pread)
    try:
        assert read_summary(fd, len(raw)) == summary_of(enc)
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert sum(asked) <= 4096 + 16384, asked
