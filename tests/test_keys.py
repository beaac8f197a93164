import hashlib

import numpy as np
import pytest

from synth import byte_table
from vllm_kvdisk.keys import (Fingerprint, Grid, KeyCache, TokenTable, as_token_array, salt_digest,
                              token_digest)
from vllm_kvdisk.planner import Prompt


def test_seed_example_positions():
    # ds4: a 10500-token conversation checkpoints at 10240 - 32 = 10208 tokens.
    assert Grid(2048, 32, 16).floor(10500) == 10208
    # On vLLM's CPU backend (block 128) the same rule lands on the block below.
    assert Grid(2048, 32, 128).floor(10500) == 10112
    assert Grid(2048, 32, 16).positions_upto(6200) == [2016, 4064, 6112]
    assert Grid(2048, 32, 16).floor(2000) == 0


def test_grid_rejects_nonsense():
    with pytest.raises(ValueError):
        Grid(32, 32, 16)
    with pytest.raises(ValueError):
        Grid(64, 8, 0)


def test_positions_are_distinct_when_align_is_below_block():
    assert Grid(64, 8, 128).positions_upto(1000) == [128, 256, 384, 512, 640, 768, 896]


def test_render_is_exact_bytes_including_broken_utf8():
    table = byte_table()
    ids = np.array([260, 104, 105, 257, 259, 258, 261, 256], dtype=np.uint32)
    text, ends = table.render(ids)
    expected = b"".join(table.piece(int(t)) for t in ids)
    assert text == expected == b"\xachi\xc3\xa9\xe2\x82\xe6\x97\xa5\xe6\x9c\xac theab"
    assert list(ends) == list(np.cumsum([len(table.piece(int(t))) for t in ids]))
    # A prefix may end inside a character: the key is over bytes, never re-encoded.
    assert text[: ends[0]].decode("utf-8", errors="replace") == "\ufffd"


def test_render_rejects_out_of_vocab():
    with pytest.raises(ValueError, match="vocabulary"):
        byte_table().render(np.array([999999]))


def test_grid_keys_equal_sha1_of_text_with_and_without_the_key_cache():
    table = byte_table()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, len(table), 500)
    text, _ = table.render(ids)
    grid = Grid(64, 8, 16)
    cache = KeyCache()
    plain = Prompt(table, grid, ids)
    assert [k.tokens for k in plain.keys] == [48, 112, 176, 240, 304, 368, 432, 496]
    for k in plain.keys:
        assert k.sha1 == hashlib.sha1(text[: k.text_end]).hexdigest()
        assert k.text_end == len(b"".join(table.piece(int(t)) for t in ids[: k.tokens]))
    first = Prompt(table, grid, ids[:300], cache=cache)  # fills the cache up to 240
    assert len(cache) == 4
    # A longer prompt with the same start reuses those states and hashes only its tail...
    longer = Prompt(table, grid, ids, cache=cache)
    assert longer.keys == plain.keys and first.keys == plain.keys[:4]
    # ...and one that diverges early is not fooled by the cached states.
    other = ids.copy()
    other[100] = (other[100] + 1) % len(table)
    diverged = Prompt(table, grid, other, cache=cache)
    assert diverged.keys[0] == plain.keys[0] and diverged.keys[1] != plain.keys[1]
    assert diverged.keys == Prompt(table, grid, other).keys


def test_token_lists_convert_and_reject_bad_ids():
    assert as_token_array([1, 2, 3]).dtype == np.uint32
    with pytest.raises(ValueError):
        as_token_array([-1])


def test_same_text_different_tokens_gives_same_key_but_different_digest():
    table = byte_table()
    a = np.array([97, 98] * 8)  # "a","b" x 8
    b = np.array([256] * 8)  # "ab" x 8
    ta, _ = table.render(a)
    tb, _ = table.render(b)
    assert ta == tb
    assert token_digest(a) != token_digest(b)


def test_namespaces_separate_models_salts_and_layouts():
    base = Fingerprint("m", "r", "float32", "cpu:LBHNC", 128, 1, 0)
    variants = [
        Fingerprint("m2", "r", "float32", "cpu:LBHNC", 128, 1, 0),
        Fingerprint("m", "r", "bfloat16", "cpu:LBHNC", 128, 1, 0),
        Fingerprint("m", "r", "float32", "cuda:NHD", 128, 1, 0),
        Fingerprint("m", "r", "float32", "cpu:LBHNC", 16, 1, 0),
        Fingerprint("m", "r", "float32", "cpu:LBHNC", 128, 1, 0, salt_digest=salt_digest("s")),
        Fingerprint("m", "r", "float32", "cpu:LBHNC", 128, 1, 0, lora="adapter"),
    ]
    names = {base.dirname()} | {v.dirname() for v in variants}
    assert len(names) == 7
    assert salt_digest(None) == "" and "s" not in salt_digest("s")


def test_empty_table_and_prompt():
    t = TokenTable([b"x"])
    text, ends = t.render(np.array([], dtype=np.uint32))
    assert text == b"" and len(ends) == 0
