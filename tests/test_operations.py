"""Operating it: per-request control, clearing the cache, KV events for routers, the
serve command's help, the model identity, on a real engine where it takes one."""

import json
import os
import subprocess
import sys

import pytest

from engine import engine, events, generate, random_prompt, wait_events
from helpers import kv_files
from vllm_kvdisk.core.identity import model_identity, weights_digest

pytestmark = pytest.mark.engine


def test_per_request_control_skips_saves_caps_them_and_skips_loads(tiny_model, tmp_path):
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    a, b = random_prompt(1500, seed=60), random_prompt(1500, seed=61)
    with engine(tiny_model, kv, trace=trace) as llm:
        generate(llm, a, kv_params={"kvdisk": {"save": False}})
        assert kv_files(kv) == []  # nothing of this request was written
        generate(llm, b, kv_params={"kvdisk": {"max_save_tokens": 640}})
        saved = wait_events(trace, "saved")
        assert saved and max(e.tokens for e in saved) <= 640
        llm.reset_prefix_cache()
        _, cached = generate(llm, b, kv_params={"kvdisk": {"load": False, "save": False}})
        assert cached == 0  # on disk, but this request asked not to load
        assert "loading skipped by the request" in events(trace, "miss")[-1].detail
        llm.reset_prefix_cache()
        _, cached = generate(llm, b)
        assert cached == 640  # the capped checkpoint serves the next request


def test_reset_with_the_connector_clears_this_models_checkpoints_only(tiny_model, tmp_path):
    kv = str(tmp_path / "kv")
    prompt = random_prompt(1000, seed=62)
    foreign = os.path.join(kv, "0123456789abcdef")
    with engine(tiny_model, kv) as llm:
        reference, _ = generate(llm, prompt)
        assert kv_files(kv)
        os.makedirs(foreign)  # another model's namespace on the same volume
        with open(os.path.join(foreign, "namespace.json"), "w") as fh:
            json.dump({"model": "someone-else", "revision": "x"}, fh)
        assert llm.reset_prefix_cache(reset_connector=True)
        assert kv_files(kv) == [] and os.path.isdir(foreign)
        tokens, cached = generate(llm, prompt)
        assert cached == 0 and tokens == reference  # recomputed, still exact
        assert kv_files(kv)  # and checkpointed again


def test_kv_events_announce_disk_blocks_with_the_engines_own_hashes(tiny_model, tmp_path):
    from vllm.config.kv_events import KVEventsConfig

    kv = str(tmp_path / "kv")
    prompt = random_prompt(1000, seed=63)
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    with engine(tiny_model, kv, llm_args={"kv_events_config": cfg},
                kv_disk_space_mb=4, kv_disk_min_free_mb=0) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        batches = []
        scheduler.kv_event_publisher.publish = batches.append  # what a router would receive
        generate(llm, prompt)
        generate(llm, random_prompt(300, seed=64))  # one more step: the report lands
        for seed in range(65, 68):  # ~2.6 MB each against a 4 MiB budget: evictions
            generate(llm, random_prompt(1000, seed=seed))
            generate(llm, random_prompt(300, seed=seed + 10))
    found = [e for b in batches for e in b.events]
    gpu = {h for e in found if type(e).__name__ == "BlockStored" and e.medium == "GPU"
           for h in e.block_hashes}
    disk = [e for e in found if type(e).__name__ == "BlockStored" and e.medium == "STORAGE"]
    assert disk, [type(e).__name__ for e in found]
    first = disk[0]
    assert first.block_size == 128 and len(first.block_hashes) == 896 // 128
    assert first.token_ids == prompt[:896] and first.parent_block_hash is None
    assert set(first.block_hashes) <= gpu  # the same hashes vLLM gives these blocks
    removed = [e for e in found if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE"]
    assert removed and set(removed[0].block_hashes) <= {h for e in disk for h in e.block_hashes}


def test_serve_help_lists_the_cache_flags_first_then_vllms(tmp_path):
    out = subprocess.run([sys.executable, "-m", "vllm_kvdisk.serve", "serve", "--help"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    ours, theirs = text.index("--kv-disk-dir"), text.index("usage: vllm serve")
    assert ours < theirs and "KVDISK_SPACE_MB" in text and "--no-kv-cache-tail-checkpoints" in text
    bad = subprocess.run([sys.executable, "-m", "vllm_kvdisk.serve", "serve", "m",
                          "--kv-disk-dir", str(tmp_path), "--kv-disk-space-mb", "-3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "kv_disk_space_mb: must be >= 1" in bad.stderr


def test_a_fine_tune_saved_over_the_same_path_is_another_namespace(tmp_path):
    """Same config, same shapes, other weights: before, the namespace was a digest of
    config.json only, and the old model's checkpoints would have been restored."""
    import struct

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 18], "data_offsets": [0, 1 << 20]}})
    blob = struct.pack("<Q", len(header)) + header.encode()

    def weights(fill: bytes) -> None:
        (model / "model.safetensors").write_bytes(blob + fill * (1 << 20))

    weights(b"\x01")
    before = weights_digest(str(model))
    assert weights_digest(str(model)) == before  # stable
    weights(b"\x02")  # fine-tuned: every weight moved, nothing else did
    assert weights_digest(str(model)) != before
    assert model_identity(str(model), None)[1].startswith("weights-")
    hub = tmp_path / "hub" / "models--org--m" / "refs"
    hub.mkdir(parents=True)
    (hub / "main").write_text("abc123\n")
    os.environ["HF_HUB_CACHE"] = str(tmp_path / "hub")
    try:
        assert model_identity("org/m", None) == ("org/m", "commit-abc123")
    finally:
        del os.environ["HF_HUB_CACHE"]
