"""Bad files, other models and other salts: always a miss, never a wrong answer."""

import os

import pytest
from engine import engine, events, generate, random_prompt
from helpers import kv_files

from vllm_kvdisk.core.format import FORMAT_VERSION
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("damage", ["flip_page_byte", "truncate"])
def test_corrupt_file_is_quarantined_and_the_answer_is_still_right(tiny_model, tmp_path, damage):
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    prompt = random_prompt(1000, seed=5)
    with engine(tiny_model, kv, trace=trace) as llm:
        reference, _ = generate(llm, prompt)
        (path,) = kv_files(kv)
        raw = bytearray(open(path, "rb").read())
        if damage == "flip_page_byte":
            raw[len(raw) // 2] ^= 0x10  # inside a layer's pages: only the checksum sees it
        else:
            raw = raw[: len(raw) - 4096]
        with open(path, "wb") as fh:
            fh.write(raw)
        llm.reset_prefix_cache()
        tokens, _ = generate(llm, prompt)
        assert tokens == reference
        quarantined = [n for n in os.listdir(os.path.join(kv, "quarantine")) if n.endswith(".kv")]
        assert len(quarantined) == 1 and events(trace, "quarantined")
        # The recomputed prefix was saved again: the file under that name is sound now.
        assert (
            open(path, "rb").read() != bytes(raw)
            and verify(Store(kv, space_bytes=1 << 40, readonly=True)).ok
        )
        llm.reset_prefix_cache()
        again, _ = generate(llm, prompt)  # the engine keeps serving, still exact
        assert again == reference


def test_garbage_files_at_startup_are_quarantined_and_the_server_serves(tiny_model, tmp_path):
    kv = str(tmp_path / "kv")
    prompt = random_prompt(1000, seed=6)
    with engine(tiny_model, kv) as llm:
        reference, _ = generate(llm, prompt)
    (path,) = kv_files(kv)
    ns_dir = os.path.dirname(path)
    with open(os.path.join(ns_dir, "0" * 40 + ".kv"), "wb") as fh:
        fh.write(os.urandom(5000))  # hostile: random bytes under a valid name
    with open(os.path.join(ns_dir, "f" * 40 + ".kv"), "wb") as fh:
        fh.write(b"KVC" + bytes([FORMAT_VERSION]) + b"\xff" * 100)  # claims absurd sizes
    with engine(tiny_model, kv) as llm:
        tokens, cached = generate(llm, prompt)
    assert tokens == reference and cached == 896
    assert kv_files(kv) == [path]
    assert len([n for n in os.listdir(os.path.join(kv, "quarantine")) if n.endswith(".kv")]) == 2


def test_checkpoint_of_another_model_is_a_miss(tiny_model, other_model, tmp_path):
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    prompt = random_prompt(1000, seed=7)
    with engine(tiny_model, kv) as llm:
        generate(llm, prompt)
    with engine(other_model, kv, trace=trace) as llm:
        tokens, cached = generate(llm, prompt)
    with engine(other_model, None, prefix_caching=False) as llm:
        reference, _ = generate(llm, prompt)
    assert cached == 0 and tokens == reference
    misses = events(trace, "miss")
    assert misses and "another model" in misses[0].detail
    assert len({os.path.dirname(p) for p in kv_files(kv)}) == 2  # one namespace per model


def test_other_cache_salt_is_a_miss_and_same_salt_hits(tiny_model, tmp_path):
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    prompt = random_prompt(1000, seed=8)
    with engine(tiny_model, kv) as llm:
        generate(llm, prompt, salt="tenant-a")
    # A new engine indexes tenant-a's file at start: its lookups see it from the first one.
    with engine(tiny_model, kv, trace=trace) as llm:
        _, cached_b = generate(llm, prompt, salt="tenant-b")
        llm.reset_prefix_cache()
        _, cached_none = generate(llm, prompt)
        llm.reset_prefix_cache()
        _, cached_a = generate(llm, prompt, salt="tenant-a")
    assert (cached_b, cached_none, cached_a) == (0, 0, 896)
    # The misses of another salt and of no salt read as for a prompt nobody stored: a
    # reason naming tenant-a's namespace would confirm its prompt to them.
    misses = [e.detail for e in events(trace, "miss")]
    assert len(misses) == 2 and all(m.startswith("no checkpoint") for m in misses), misses
    for path in kv_files(kv):
        assert b"tenant" not in open(path, "rb").read()  # the salt itself is never stored
