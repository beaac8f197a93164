"""Hybrid models, without an engine: which sliding-window pages a hit needs and which file
gives them, partial-file hits, and which KV cache groups are served or refused."""

import pytest

from vllm_kvdisk.core.compat import GroupInfo, UnsupportedConfig, groups_signature, kv_groups
from vllm_kvdisk.core.format import Group, GroupKind, Reason, window_blocks
from vllm_kvdisk.core.index import Entry, Lookup, Miss, Segment
from vllm_kvdisk.core.planner import trim_to_windows, window_sources

B, W = 128, 256  # the tiny Gemma 3: block 128, window 256 (a hit needs 2 blocks)


def entry(parent_tokens: int, tokens: int, name: str = "f") -> Entry:
    return Entry(
        "ns",
        f"{name}{tokens}",
        tokens,
        None if not parent_tokens else "p",
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


def test_a_window_group_holds_the_window_before_the_files_end():
    # vLLM skips tokens below hit - window + 1: a hit at 1408 attends to 1153.. (block 9)
    assert window_blocks(1408, W, B) == (9, 2)
    assert window_blocks(128, W, B) == (0, 1)  # shorter than the window: all of it
    assert window_blocks(1408, 129, B) == (10, 1)


def test_a_whole_file_gives_its_own_window():
    assert window_sources([(1408, 1408)], 1408, 0, W, B) == [(9, 11)]
    # blocks the device already holds are not read
    assert window_sources([(1408, 1408)], 1408, 1280, W, B) == [(10, 11)]


def test_a_partial_file_hit_is_served_where_its_window_and_its_parents_cover_it():
    # parent ends at 1408 (window blocks 9, 10), child ends at 1664 (blocks 11, 12); a
    # prompt leaving the child at 1536 needs blocks 10 and 11: one from each file.
    assert window_sources([(1408, 1408), (1664, 1536)], 1536, 0, W, B) == [(10, 11), (11, 12)]


def test_a_partial_file_hit_far_from_the_files_end_is_not_served():
    assert window_sources([(1408, 896)], 896, 0, W, B) is None
    # a gap between the parent's window and the child's
    assert window_sources([(1408, 1408), (2048, 1792)], 1792, 0, W, B) is None


def test_trim_steps_back_to_the_deepest_stored_window():
    # the prompt leaves a 2048-token file at 1792: its window (blocks 14, 15) is past
    # that, the parent's (blocks 9, 10) below; the deepest servable hit is the parent's end
    trimmed = trim_to_windows(lookup((0, 1408, 1408), (1408, 2048, 1792)), 0, [W], B)
    assert trimmed.tokens == 1408 and trimmed.miss == Miss.WINDOW_NOT_STORED
    # nothing stored below: no hit at all
    none = trim_to_windows(lookup((0, 1408, 896)), 0, [W], B)
    assert none.tokens == 0 and none.miss == Miss.WINDOW_NOT_STORED
    # covered: unchanged
    ok = lookup((0, 1408, 1408), (1408, 1664, 1536))
    assert trim_to_windows(ok, 0, [W], B) is ok
    # no window group, or the device holds at least as much: unchanged
    assert trim_to_windows(none, 0, [], B) is none
    assert trim_to_windows(lookup((0, 1408, 896)), 896, [W], B).tokens == 896


def test_the_device_hit_covers_what_it_holds():
    # the device holds 1280 tokens (blocks 0..9): a partial use of a file up to 1408 that
    # stores only blocks 11, 12 cannot give block 10
    assert trim_to_windows(lookup((0, 1664, 1408)), 1280, [W], B).tokens == 0
    assert trim_to_windows(lookup((0, 1536, 1408)), 1280, [W], B).tokens == 1408


def info(spec: str, **kw) -> GroupInfo:
    return GroupInfo(
        spec, kw.pop("layers", 2), kw.pop("block", B), kw.pop("page", ("f32", 2, 64)), **kw
    )


def test_full_and_window_groups_are_served():
    groups = kv_groups(
        [
            info("SlidingWindowSpec", window=W),
            info("SlidingWindowSpec", window=W),
            info("FullAttentionSpec", full=True),
        ]
    )
    assert groups == (
        Group(GroupKind.WINDOW, 2, W),
        Group(GroupKind.WINDOW, 2, W),
        Group(GroupKind.FULL, 2),
    )
    assert groups_signature(groups) == "/Gw256x2,w256x2,fx2"
    assert groups_signature((Group(GroupKind.FULL, 4),)) == ""  # the layout it always had


@pytest.mark.parametrize(
    "spec,words",
    [
        ("MambaSpec", "Mamba / linear-attention states in vLLM's mamba cache mode 'none'"),
        ("ChunkedLocalAttentionSpec", "chunked local"),
        ("SinkFullAttentionSpec", "SinkFullAttentionSpec"),
    ],
)
def test_state_and_other_groups_are_refused_with_the_reason(spec, words):
    with pytest.raises(UnsupportedConfig, match=words):
        kv_groups([info(spec), info("FullAttentionSpec", full=True)])


def test_groups_of_another_page_geometry_are_refused():
    with pytest.raises(UnsupportedConfig, match="same page geometry"):
        kv_groups(
            [info("FullAttentionSpec", full=True), info("SlidingWindowSpec", window=W, block=64)]
        )


def test_the_block_size_an_engine_core_reset_after_start_up_is_put_back():
    """vLLM 0.32's multi-process engine core re-runs the CPU platform's config check after
    its handshake, which sets an unspecified block size to 128 under a scheduler built
    for the KV cache groups' 640 (wiring.restore_block_size)."""
    from vllm.config import CacheConfig

    from vllm_kvdisk.connector.wiring import restore_block_size

    cache = CacheConfig()
    cache.block_size = 128
    assert restore_block_size(cache, 640) and cache.block_size == 640
    assert not restore_block_size(cache, 640) and cache.block_size == 640


def test_vllm_specs_are_read_as_their_kind():
    """The wiring's reading of vLLM's own spec objects (0.32)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from vllm_kvdisk.connector.wiring import group_info

    full = FullAttentionSpec(block_size=B, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=B, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=W
    )
    assert kv_groups([group_info(window, 2), group_info(full, 2)]) == (
        Group(GroupKind.WINDOW, 2, W),
        Group(GroupKind.FULL, 2),
    )
    # A Mamba state padded to the attention page (vLLM's align mode) is a state group;
    # the same unpadded, or in another cache mode, is refused.
    page = full.page_size_bytes
    mamba = MambaSpec(
        block_size=B,
        shapes=((4, 8), (2, 2)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
        page_size_padded=page,
    )
    info = group_info(mamba, 2)
    assert info.state == (((4, 8), "bfloat16"), ((2, 2), "float32")) and info.page_bytes == page
    assert kv_groups([info, group_info(full, 2)]) == (
        Group(GroupKind.STATE, 2),
        Group(GroupKind.FULL, 2),
    )
    unpadded = MambaSpec(
        block_size=B, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    with pytest.raises(UnsupportedConfig, match="aligned layout"):
        kv_groups([group_info(unpadded, 2), group_info(full, 2)])
    other_mode = MambaSpec(
        block_size=B,
        shapes=((4, 8),),
        dtypes=(torch.float32,),
        mamba_cache_mode="all",
        page_size_padded=page,
    )
    with pytest.raises(UnsupportedConfig, match="mamba cache mode 'all'"):
        kv_groups([group_info(other_mode, 2), group_info(full, 2)])
