"""Mamba / linear-attention state groups, without an engine: the format's state group and
its payload version, where a hit may end, which blocks a load fills and a save stores,
the state blocks vLLM hands over (pinned in vLLM's own block pool), the groups served or
refused, and the raw block pages a state layer is copied as."""

import struct
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_kvdisk.connector.groupblocks import GroupBlocks
from vllm_kvdisk.connector.jobs import LoadFile, LoadJob
from vllm_kvdisk.connector.statehandoffs import StateHandoffs
from vllm_kvdisk.connector.transfer import PageMover, block_pages
from vllm_kvdisk.core.compat import (
    GroupInfo,
    UnsupportedConfig,
    groups_signature,
    kv_groups,
    state_signature,
)
from vllm_kvdisk.core.encode import encode_checkpoint
from vllm_kvdisk.core.format import (
    FormatError,
    Group,
    GroupKind,
    PageLayout,
    Payload,
    Reason,
    UnsupportedFile,
    state_block,
)
from vllm_kvdisk.core.index import Entry, Lookup, Miss, Segment
from vllm_kvdisk.core.planner import trim_to_states
from vllm_kvdisk.storage.fileread import read_meta
from vllm_kvdisk.storage.pageread import read_layer_into

GOLDEN = Path(__file__).parent / "golden"
LAYOUT = PageLayout("cpu:raw", 4, 2, (32,), "uint8")
# Layer 0 full attention (the owned block), layer 1 a state group (the state at 8 tokens:
# block 8 / 4 - 1 = 1).
STATEFUL = (Group(GroupKind.FULL, 1), Group(GroupKind.STATE, 1))
B = 640  # the tiny Qwen3-Next: vLLM aligns its blocks to 640 tokens


def state_checkpoint() -> bytes:
    """A tiny delta with a state group; its bytes are pinned in tests/golden/."""
    layers = [bytes([1]) * 32, bytes([2]) * 32]
    payload = Payload(
        bytes(range(32)), "ab" * 20, 4, 1, 1, LAYOUT, 0x0123456789ABCDEF, groups=STATEFUL
    )
    enc = encode_checkpoint(
        text=b"abcdefgh",
        tokens=np.arange(8, dtype="<u4").tobytes(),
        layers=layers,
        payload=payload,
        reason=Reason.CONTINUED,
        kv_dtype="uint8",
        context_size=8192,
        now=1_700_000_000,
    )
    return b"".join(bytes(b) for b in enc.buffers)


def write(tmp_path, raw: bytes) -> int:
    import os

    path = tmp_path / "f.kv"
    path.write_bytes(raw)
    return os.open(path, os.O_RDONLY)


def test_golden_state_file_pins_the_layout(tmp_path):
    raw = state_checkpoint()
    assert raw == (GOLDEN / "v2_state_delta.kv").read_bytes()
    payload = 52 + struct.unpack_from("<I", raw, 48)[0]
    assert raw[3] == 2  # the file's format version is unchanged (same namespaces)
    assert struct.unpack_from("<H", raw, payload + 4)[0] == 3  # payload version 3
    # kind, zero, layers, window, first block, block count: the state after token 8
    assert struct.unpack_from("<BBHIII", raw, payload + 160) == (1, 0, 1, 0, 1, 1)
    assert struct.unpack_from("<BBHIII", raw, payload + 176) == (3, 0, 1, 0, 1, 1)
    meta = read_meta(write(tmp_path, raw), len(raw))
    assert meta.payload.version == 3
    assert meta.payload.groups == (
        Group(GroupKind.FULL, 1, 0, 1, 1),
        Group(GroupKind.STATE, 1, 0, 1, 1),
    )
    page = bytearray(32)
    read_layer_into(write(tmp_path, raw), meta, 1, memoryview(page))
    assert bytes(page) == bytes([2]) * 32


def test_a_state_group_only_in_a_version_3_payload(tmp_path):
    """A reader that knows payload version 2 only leaves state files alone (unsupported);
    this one reads both, and a state group in a version 2 payload, a version 3 payload
    without one, or a state block other than the file's last is corrupt."""
    raw = state_checkpoint()
    payload = 52 + struct.unpack_from("<I", raw, 48)[0]
    cases = {
        "v2 with a state": (payload + 4, "<H", 2),
        "v3 without a state": (payload + 176, "<B", 1),
        "state not at the end": (payload + 176 + 8, "<I", 0),
        "two state blocks": (payload + 176 + 12, "<I", 2),
    }
    for name, (at, fmt, value) in cases.items():
        bad = bytearray(raw)
        struct.pack_into(fmt, bad, at, value)
        with pytest.raises(FormatError) as err:
            read_meta(write(tmp_path, bytes(bad)), len(bad))
        assert not isinstance(err.value, UnsupportedFile), name
    future = bytearray(raw)
    struct.pack_into("<H", future, payload + 4, 5)
    with pytest.raises(UnsupportedFile, match="payload version 5"):
        read_meta(write(tmp_path, bytes(future)), len(future))


def test_the_state_after_n_tokens_is_in_block_n_over_block_size_minus_one():
    assert state_block(1280, B) == 1
    assert Group(GroupKind.STATE, 2).placed(1280, 2560, B) == Group(GroupKind.STATE, 2, 0, 3, 1)


def entry(parent_tokens: int, tokens: int) -> Entry:
    return Entry(
        "ns",
        f"f{tokens}",
        tokens,
        "p" if parent_tokens else None,
        parent_tokens,
        Reason.COLD,
        0,
        0,
        0,
        1,
        0,
        0,
    )


def lookup(*segments: tuple[int, int, int]) -> Lookup:
    """Segments (parent_tokens, tokens, upto)."""
    return Lookup([Segment(entry(p, t), u) for p, t, u in segments])


def test_a_hit_ends_where_a_file_ends():
    whole = lookup((0, 1280, 1280), (1280, 2560, 2560))
    assert trim_to_states(whole, 0) is whole
    # leaves the child at 1920: its state is at 2560 only, the parent's at 1280
    cut = trim_to_states(lookup((0, 1280, 1280), (1280, 2560, 1920)), 0)
    assert cut.tokens == 1280 and cut.miss == Miss.STATE_NOT_STORED
    # a branch inside the parent: the parent used up to 640, no state there
    none = trim_to_states(lookup((0, 1280, 640)), 0)
    assert none.tokens == 0 and none.miss == Miss.STATE_NOT_STORED
    # the device holds as much: nothing to load, nothing to trim
    short = lookup((0, 1280, 640))
    assert trim_to_states(short, 640) is short


def test_a_load_fills_the_hits_state_block_from_the_last_file():
    blocks = GroupBlocks((Group(GroupKind.STATE, 2), Group(GroupKind.FULL, 2)), B)
    blocks.null_block = 0
    segments = [Segment(entry(0, 1280), 1280), Segment(entry(1280, 2560), 2560)]
    files = [
        LoadFile(s.entry.sha1, s.entry.parent_tokens, s.upto, s.entry.tokens) for s in segments
    ]
    job = LoadJob("r", None, files, 0, [11, 12, 13, 14])
    # vLLM's state table for a hit of 2560: the null block, then a fresh block at 3
    blocks.place(job, segments, [[0, 0, 0, 7], [11, 12, 13, 14]], 0, 2560)
    assert [f.ranges for f in job.files] == [((0, 0), (0, 2)), ((3, 4), (2, 4))]
    assert job.groups == [[0, 0, 0, 7], [11, 12, 13, 14]]
    # a hit that leaves the last file early has no state to load: refused, never wrong
    part = [segments[0], Segment(segments[1].entry, 1920)]
    with pytest.raises(ValueError, match="state"):
        blocks.place(
            LoadJob("r", None, files, 0, [11, 12, 13]), part, [[0, 0, 7], [11, 12, 13]], 0, 1920
        )
    # the state block vLLM gave is its null block: refused
    with pytest.raises(ValueError, match="null"):
        blocks.place(
            LoadJob("r", None, files, 0, [11, 12, 13, 14]),
            segments,
            [[0, 0, 0, 0], [11, 12, 13, 14]],
            0,
            2560,
        )


def test_a_save_stores_the_handed_over_state_block():
    blocks = GroupBlocks((Group(GroupKind.STATE, 2), Group(GroupKind.FULL, 2)), B)
    blocks.null_block = 0
    tables = [[0, 0, 5, 6], [11, 12, 13, 14]]
    assert blocks.stored(tables, 1280, 2560, {0: 9}) == [[9], [13, 14]]
    assert blocks.stored(tables, 1280, 2560, None) is None  # no state held there
    assert blocks.main(tables) == [11, 12, 13, 14]  # counts come from attention


def step(offers: dict) -> object:
    from vllm.v1.core.sched.output import KVConnectorBlockState

    state = KVConnectorBlockState(set(offers), lambda r: (), offers)
    return types.SimpleNamespace(kv_connector_block_state=state)


def test_the_newest_whole_boundary_is_pinned_in_vllms_block_pool():
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(32, True, B)
    held = pool.get_new_blocks(4)  # a request's state blocks, as vLLM allocated them
    ids = [b.block_id for b in held]
    states = StateHandoffs((Group(GroupKind.FULL, 2), Group(GroupKind.STATE, 2)))
    states.pool = pool
    free = pool.get_num_free_blocks()
    # group 0 is not a state group: its offers are ignored; a boundary needs every state group
    states.take(step({"r": [(1, ids[0], 1280), (0, ids[1], 1280)]}), lambda r, t: True)
    assert states.boundary("r") == (1280, {1: ids[0]})
    states.take(step({"x": [(1, ids[2], 640)]}), lambda r, t: r != "x")  # may not save
    assert states.boundary("x") is None
    pool.free_blocks([held[0]])  # vLLM moves on and frees the block: the pin keeps it
    assert held[0].ref_cnt == 1 and pool.get_num_free_blocks() == free
    states.take(step({"r": [(1, ids[3], 1920)]}), lambda r, t: True)  # a newer boundary
    assert states.boundary("r") == (1920, {1: ids[3]})
    assert held[0].ref_cnt == 0 and pool.get_num_free_blocks() == free + 1
    states.take(step({"r": [(1, ids[1], 640)]}), lambda r, t: True)  # an older one: ignored
    assert states.boundary("r")[0] == 1920
    # a request that finishes with a save planned keeps its pin until finished_sending
    states.finished("r", saving=True)
    assert states.pinned == 1 and held[3].ref_cnt == 2
    states.released({"r"})
    assert states.pinned == 0 and held[3].ref_cnt == 1
    states.take(step({"s": [(1, ids[2], 640)]}), lambda r, t: True)
    states.finished("s", saving=False)
    assert states.pinned == 0 and held[2].ref_cnt == 1


def test_a_junction_state_is_named_in_the_step_that_offers_it():
    """vLLM keeps a state where a request's full-attention hit ran past its state hit
    (``shared_prefix_boundary``: conversations sharing a prefix meet there) and offers it
    one step before the replay boundary, whose pin replaces it: ``take`` names the
    requests pinned anew, and ``junction`` says when the pin is that junction, so the
    scheduler saves it in that step."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(32, True, B)
    ids = [b.block_id for b in pool.get_new_blocks(3)]
    states = StateHandoffs((Group(GroupKind.STATE, 2), Group(GroupKind.FULL, 2)))
    states.pool = pool
    request = types.SimpleNamespace(shared_prefix_boundary=1280)
    assert states.take(step({"r": [(0, ids[0], 1280)]}), lambda r, t: True) == ["r"]
    assert states.junction("r", request) == 1280
    assert states.junction("r", types.SimpleNamespace(shared_prefix_boundary=0)) == 0
    assert states.take(step({"r": [(0, ids[1], 1920)]}), lambda r, t: True) == ["r"]
    assert states.junction("r", request) == 0  # the replay boundary: the rules save it
    assert states.take(step({"r": [(0, ids[2], 640)]}), lambda r, t: True) == []  # older


def info(spec: str, **kw) -> GroupInfo:
    return GroupInfo(
        spec,
        kw.pop("layers", 2),
        kw.pop("block", B),
        kw.pop("page", ("bf16", 2, 64)),
        page_bytes=kw.pop("page_bytes", 327680),
        **kw,
    )


STATE = (((3, 1024), "bfloat16"), ((4, 128, 128), "float32"))


def test_state_groups_in_align_mode_are_served_beside_attention():
    groups = kv_groups(
        [info("MambaSpec", state_mode="align", state=STATE), info("FullAttentionSpec", full=True)]
    )
    assert groups == (Group(GroupKind.STATE, 2), Group(GroupKind.FULL, 2))
    sig = groups_signature(groups, (state_signature(STATE),))
    assert sig == "/Gs2[3x1024:bfloat16+4x128x128:float32],fx2"


@pytest.mark.parametrize(
    "groups,words",
    [
        (
            [info("MambaSpec", state_mode="none"), info("FullAttentionSpec", full=True)],
            "mamba cache mode 'none'",
        ),
        (
            [
                info("MambaSpec", state_mode="align", speculative_blocks=1),
                info("FullAttentionSpec", full=True),
            ],
            "speculative",
        ),
        ([info("MambaSpec", state_mode="align")], "only Mamba"),
        (
            [
                info("MambaSpec", state_mode="align", page_bytes=268288),
                info("FullAttentionSpec", full=True),
            ],
            "aligned layout",
        ),
    ],
)
def test_state_groups_kvdisk_cannot_restore_exactly_are_refused(groups, words):
    with pytest.raises(UnsupportedConfig, match=words):
        kv_groups(groups)


def state_layer(num_blocks: int, page: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A state layer as vLLM 0.32 lays it out: a conv state (bf16) and an SSM state (fp32)
    at the start of each block's page, padded to the attention page."""
    raw = torch.arange(num_blocks * page, dtype=torch.int64).remainder(251).to(torch.uint8)
    conv = torch.as_strided(raw.view(torch.bfloat16), (num_blocks, 3, 8), (page // 2, 8, 1), 0)
    ssm = torch.as_strided(
        raw.view(torch.float32), (num_blocks, 2, 4, 4), (page // 4, 16, 4, 1), 12
    )
    return raw, [conv, ssm]


def test_a_state_layer_is_copied_as_its_blocks_raw_pages():
    raw, views = state_layer(6, 256)
    pages = block_pages(views, 6)
    assert tuple(pages.shape) == (6, 256)
    assert torch.equal(pages.reshape(-1), raw)  # block b: the page from its first byte
    mover = PageMover([pages, block_pages(torch.zeros(6, 2, 32), 6)], 4, "cpu:raw")
    assert mover.host_resident and mover.page_bytes == 256
    out = [np.empty(2 * 256, np.uint8), np.empty(2 * 256, np.uint8)]
    mover.gather_layers([[4, 1], [0, 0]], out)
    assert (
        out[0].tobytes()
        == raw[4 * 256 : 5 * 256].numpy().tobytes() + raw[256:512].numpy().tobytes()
    )


def test_a_layer_not_laid_out_block_by_block_is_refused():
    kv = torch.zeros(2, 6, 4, 8)  # K and V outermost: a block's bytes are two runs
    with pytest.raises(ValueError, match="block by block"):
        block_pages(kv.transpose(0, 1), 6)
    with pytest.raises(ValueError, match="blocks of one buffer"):
        block_pages([torch.zeros(6, 8), torch.zeros(6, 8)], 6)


def test_a_state_save_is_made_at_its_boundary_only(tmp_path):
    """A state model's save goes where the handed-over state is: a cap below that
    position (``max_save_tokens``) makes no checkpoint rather than one at the cap whose
    state would be another position's."""
    from synth import GRID, byte_table, make, planner

    from vllm_kvdisk.connector.events import DiskEvents
    from vllm_kvdisk.connector.jobs import Scope
    from vllm_kvdisk.connector.saveplans import SavePlanning
    from vllm_kvdisk.core.control import RequestControl
    from vllm_kvdisk.core.lifecycle import RequestState
    from vllm_kvdisk.core.saverules import SaveRules

    store, ns = make(tmp_path)
    bs = GRID.block_size
    groups = (Group(GroupKind.STATE, 1), Group(GroupKind.FULL, 1))
    blocks = GroupBlocks(groups, bs)
    blocks.null_block = 0
    saves = SavePlanning(
        planner=planner(store),
        rules=SaveRules(GRID, bs, 1 << 20, 1 << 20),
        table=byte_table(),
        blocks=blocks,
        events=DiskEvents(False, bs),
        store=store,
        context_size=8192,
        workers=1,
    )
    ids = list(range(10, 10 + 8 * bs))
    tables = [[0] * 6 + [99, 0], list(range(1, 9))]  # the state after 6 blocks: block 99

    def state(cap):
        request = types.SimpleNamespace(request_id="r", all_token_ids=ids)
        return RequestState(request, Scope(), ns, RequestControl(max_save_tokens=cap))

    capped = state(4 * bs + 3)
    assert not saves.plan(capped, [(6 * bs, Reason.COLD)], tables, states={0: 99})
    assert saves.take() == []
    assert saves.plan(state(None), [(6 * bs, Reason.COLD)], tables, states={0: 99})
    (job,) = saves.take()
    assert job.plan.tokens == 6 * bs and job.groups == [[99], list(range(1, 7))]
