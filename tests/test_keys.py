import numpy as np
import pytest
from synth import byte_table

from vllm_kvdisk.core.keys import (
    Fingerprint,
    Namespaces,
    as_token_array,
    salt_digest,
    token_digest,
)
from vllm_kvdisk.core.tokens import TokenTable

KEY = bytes(range(32))  # a cache directory's salt key (storage/secret.py)


def test_render_is_exact_bytes_including_broken_utf8():
    table = byte_table()
    ids = np.array([260, 104, 105, 257, 259, 258, 261, 256], dtype=np.uint32)
    text, ends = table.render(ids)
    expected = b"".join(table.piece(int(t)) for t in ids)
    assert text == expected == b"\xachi\xc3\xa9\xe2\x82\xe6\x97\xa5\xe6\x9c\xac theab"
    assert list(ends) == list(np.cumsum([len(table.piece(int(t))) for t in ids]))
    # A prefix may end inside a character: the key is over bytes, never re-encoded.
    assert text[: ends[0]].decode("utf-8", errors="replace") == "\ufffd"


def test_ids_outside_the_vocabulary_render_as_a_replacement_character():
    # Padded vocabularies sample ids the tokenizer has no text for: never an error.
    table = byte_table()
    text, ends = table.render(np.array([65, 999999, 66]))
    assert text == b"A\xef\xbf\xbdB" and ends.tolist() == [1, 4, 5]
    assert table.piece(999999) == table.UNKNOWN and len(table) == 262


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
        Fingerprint(
            "m", "r", "float32", "cpu:LBHNC", 128, 1, 0, salt_digest=salt_digest("s", key=KEY)
        ),
        Fingerprint("m", "r", "float32", "cpu:LBHNC", 128, 1, 0, lora="adapter"),
    ]
    names = {base.dirname()} | {v.dirname() for v in variants}
    assert len(names) == 7
    assert salt_digest(None, key=KEY) == "" and "s" not in salt_digest("s", key=KEY)


def test_a_scope_names_one_namespace_per_engine_rank():
    """Both halves ask Namespaces for a request's namespace: the scope's fingerprint on
    their rank's engine fingerprint, and its directory name."""
    rank0 = Fingerprint("m", "r", "float32", "cpu:LBHNC", 128, 2, 0)
    rank1 = Fingerprint("m", "r", "float32", "cpu:LBHNC", 128, 2, 1)
    salt = salt_digest("tenant", key=KEY)
    scoped = Namespaces(rank0).fingerprint("adapter", salt)
    assert scoped == Fingerprint(
        "m", "r", "float32", "cpu:LBHNC", 128, 2, 0, lora="adapter", salt_digest=salt
    )
    assert Namespaces(rank0).name("adapter", salt) == scoped.dirname()
    names = {
        Namespaces(fp).name(lora, s)
        for fp in (rank0, rank1)
        for lora in ("", "adapter")
        for s in ("", salt)
    }
    assert len(names) == 8


def test_empty_table_and_prompt():
    t = TokenTable([b"x"])
    text, ends = t.render(np.array([], dtype=np.uint32))
    assert text == b"" and len(ends) == 0


def test_rank_group_joins_the_ranks_of_one_engine_only():
    from dataclasses import asdict, replace

    from vllm_kvdisk.core.keys import Fingerprint, rank_group

    fp = Fingerprint("m", "r", "float32", "NHD", 16, 4, 0)
    info = [
        {"digest": replace(fp, tp_rank=r).digest().hex(), **asdict(replace(fp, tp_rank=r))}
        for r in range(4)
    ]
    assert len({rank_group(i) for i in info}) == 1 and rank_group(info[0]) is not None
    assert rank_group({**info[0], "model": "other"}) != rank_group(info[0])
    assert rank_group({**info[0], "salt_digest": "ab"}) != rank_group(info[0])
    assert rank_group(asdict(replace(fp, tp_size=1))) is None
    assert rank_group({"tp_size": "x"}) is None and rank_group({}) is None


def test_a_salt_with_a_lone_surrogate_has_a_digest_of_its_own():
    """A client's cache_salt is any JSON string: a lone surrogate raised UnicodeEncodeError
    in every hook of that request."""
    from vllm_kvdisk.core.keys import salt_digest

    assert (
        salt_digest("\ud800", key=KEY) != salt_digest("\ud801", key=KEY) != salt_digest("", key=KEY)
    )
    assert salt_digest("a\ud800", key=KEY) == salt_digest("a\ud800", key=KEY)
