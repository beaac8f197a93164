"""Hybrid models, without an engine: which sliding-window pages a hit needs and which file
gives them, partial-file hits, and which KV cache groups are served or refused."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_kvdisk.core.compat import GroupInfo, UnsupportedConfig, groups_signature, kv_groups
from vllm_kvdisk.core.format import Group, GroupKind, Reason, window_blocks, window_held
from vllm_kvdisk.core.index import Entry, Lookup, Miss, Segment
from vllm_kvdisk.core.planner import trim_to_windows, window_files, window_sources

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
    assert window_sources([(1408, 1408, 0)], 1408, 0, W, B) == [(9, 11)]
    # blocks the device already holds are not read
    assert window_sources([(1408, 1408, 0)], 1408, 1280, W, B) == [(10, 11)]


def test_a_partial_file_hit_is_served_where_its_window_and_its_parents_cover_it():
    # parent ends at 1408 (window blocks 9, 10), child ends at 1664 (blocks 11, 12); a
    # prompt leaving the child at 1536 needs blocks 10 and 11: one from each file.
    assert window_sources([(1408, 1408, 0), (1664, 1536, 1408)], 1536, 0, W, B) == [
        (10, 11),
        (11, 12),
    ]


def test_a_partial_file_hit_far_from_the_files_end_is_not_served():
    assert window_sources([(1408, 896, 0)], 896, 0, W, B) is None
    # a gap between the parent's window and the child's
    assert window_sources([(1408, 1408, 0), (2048, 1792, 1408)], 1792, 0, W, B) is None


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
    # "wd": a window group's files leave the window their parent's chain holds to it, a
    # rule the builds before it read as corrupt: a namespace of its own
    assert groups_signature(groups) == "/Gwd256x2,wd256x2,fx2"
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


def test_a_delta_on_a_parent_ending_where_it_starts_stores_only_its_new_window_blocks():
    # an evict tail at 1280 on the cold file at 1152 (the benchmark's conversation): a hit
    # at 1280 needs blocks 8 and 9; block 8 is in the parent's window already
    assert window_held(1152, 1152) == 1152
    assert window_blocks(1280, W, B, window_held(1152, 1152)) == (9, 1)
    # a parent a whole window below: the file's window is its own blocks either way
    assert window_blocks(1664, W, B, window_held(1280, 1280)) == (11, 2)
    # a branch inside its parent (which ends at 1024, past the file's start at 512): the
    # parent's window lies past the file's start, so the file keeps its whole window
    assert window_held(512, 1024) == 0
    assert window_blocks(640, W, B, window_held(512, 1024)) == (3, 2)
    assert window_held(0, None) == 0  # a root


def test_a_hit_at_a_clipped_file_takes_the_rest_of_its_window_from_the_parent():
    chain = lookup((0, 1152, 1152), (1152, 1280, 1280))
    files = window_files(chain.segments)
    assert files == [(1152, 1152, 0), (1280, 1280, 1152)]
    # block 8 from the parent's window, block 9 from the tail's own
    assert window_sources(files, 1280, 0, W, B) == [(8, 9), (9, 10)]
    assert trim_to_windows(chain, 0, [W], B) is chain
    # the device holds blocks 0..8: only the tail is read
    assert window_sources(files, 1280, 1152, W, B) == [(0, 0), (9, 10)]
    # the parent's own position (a resent prompt, a regenerated reply) is its whole window
    at_parent = chain.cut(1, Miss.WINDOW_NOT_STORED)
    assert window_sources(window_files(at_parent.segments), 1152, 0, W, B) == [(7, 9)]
    # three clipped files deep: every block of the window comes from the chain
    deep = lookup((0, 1152, 1152), (1152, 1280, 1280), (1280, 1408, 1408))
    assert window_sources(window_files(deep.segments), 1408, 0, W, B) == [
        (0, 0),
        (9, 10),
        (10, 11),
    ]
    # a file that branches inside its parent was saved whole: nothing is asked of the parent
    branch = lookup((0, 1024, 512), (512, 640, 640))
    assert window_files(branch.segments)[1] == (640, 640, 0)
    assert window_sources(window_files(branch.segments), 640, 0, W, B) == [(0, 0), (3, 5)]


@settings(max_examples=300, deadline=None)
@given(
    window=st.integers(1, 5 * B),
    shape=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 4)), min_size=1, max_size=6),
    hit_back=st.integers(0, 8),
)
def test_every_chain_holds_each_files_window_and_is_asked_only_for_stored_blocks(
    window, shape, hit_back
):
    """Any chain, each file saved by the rule (its window less what a parent ending where
    it starts holds; a branch inside a longer parent keeps all): a hit at the last file's
    end is always served, and any hit the planner serves reads from each file only blocks
    that file stores, covering exactly the window before the hit."""
    segments, start = [], 0
    for owned, past in shape:  # the file owns `owned` blocks up to where the next leaves it
        upto = start + owned * B
        segments.append(Segment(entry(start, upto + past * B), upto))
        start = upto
    last = segments[-1]
    segments[-1] = Segment(last.entry, last.entry.tokens)  # the chain's own last file, whole
    stored = []  # per file: the blocks a save wrote, decided from its parent as it was saved
    for i, s in enumerate(segments):
        parent_end = segments[i - 1].entry.tokens if i else None
        held = window_held(s.entry.parent_tokens, parent_end)
        first, count = window_blocks(s.entry.tokens, window, B, held)
        stored.append(set(range(first, first + count)))
    end = segments[-1].entry.tokens
    files = window_files(segments)
    assert window_sources(files, end, 0, window, B) is not None
    hit = max(B, end - hit_back * B)
    part = Lookup(segments).cut_at(hit, Miss.WINDOW_NOT_STORED) if hit < end else None
    chain = part.segments if part is not None else segments
    found = window_sources(window_files(chain), hit, 0, window, B)
    if found is not None:
        read = [set(range(a, c)) for a, c in found]
        for blocks, have in zip(read, stored):
            assert blocks <= have
        assert set().union(*read) == set(range(max(0, hit - window + 1) // B, hit // B))
