import hashlib

import numpy as np
import pytest

from synth import byte_table
from vllm_kvdisk.keys import Fingerprint, Grid, TokenTable, prefix_keys, salt_digest, token_digest


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


def test_prefix_keys_equal_sha1_of_text():
    table = byte_table()
    rng = np.random.default_rng(1)
    ids = rng.integers(0, len(table), 500)
    text, ends = table.render(ids)
    keys = prefix_keys(text, ends, Grid(64, 8, 16).positions_upto(500))
    assert [k.tokens for k in keys] == [48, 112, 176, 240, 304, 368, 432, 496]
    for k in keys:
        assert k.sha1 == hashlib.sha1(text[: k.text_end]).hexdigest()
        assert k.text_end == len(b"".join(table.piece(int(t)) for t in ids[: k.tokens]))


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
