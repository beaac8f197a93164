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


def test_a_corrupt_root_under_a_sound_delta_is_served_from_disk_after_the_next_restart(
    tiny_model, tmp_path
):
    """Two turns below the first grid point: turn 1 saves its tail (the root), turn 2 its
    tail (a delta on it). A flipped byte in the root's last page, then a restart and turn 2
    again: the root is quarantined and the prefix recomputed. The delta, orphaned, used to
    stay on disk under the very name a save of turn 2's prefix writes, so nothing was saved
    (``exists``), no trace line said why, and every later restart missed. Now the delta
    goes with its root (a ``dropped`` line), the prefix is saved again, and the next
    restart restores it from disk."""
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    grid = {"kv_cache_boundary_align_tokens": 4096}  # both turns below the first grid point
    turn1 = random_prompt(300, seed=11)
    turn2 = turn1 + random_prompt(300, seed=12)
    with engine(tiny_model, kv, trace=trace, **grid) as llm:
        generate(llm, turn1)
        reference, _ = generate(llm, turn2)
    listing = Store(kv, space_bytes=1 << 40, readonly=True)
    listing.scan()
    entries = list(listing.index.entries())
    (root,) = [e for e in entries if e.parent is None]
    (delta,) = [e for e in entries if e.parent == root.sha1]
    assert (root.tokens, delta.tokens) == (256, 512) and len(entries) == 2
    path = [p for p in kv_files(kv) if os.path.basename(p) == f"{root.sha1}.kv"][0]
    raw = bytearray(open(path, "rb").read())
    raw[-100] ^= 0x10  # the root's last page: only the checksum sees it
    open(path, "wb").write(bytes(raw))
    with engine(tiny_model, kv, trace=trace, **grid) as llm:
        tokens, _ = generate(llm, turn2)
        assert tokens == reference
    with engine(tiny_model, kv, trace=trace, **grid) as llm:
        tokens, cached = generate(llm, turn2)
    assert tokens == reference and cached == 512
    assert [e.sha1 for e in events(trace, "quarantined")] == [root.sha1]
    (dropped,) = events(trace, "dropped")
    assert dropped.sha1 == delta.sha1 and root.sha1 in dropped.detail
    saved = [e for e in events(trace, "saved") if e.sha1 == delta.sha1]
    assert len(saved) == 2  # turn 2's prefix, saved again under its name (a root now)
    assert verify(Store(kv, space_bytes=1 << 40, readonly=True)).ok
