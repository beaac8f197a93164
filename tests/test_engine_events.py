"""KV cache events for routers: what lands on and leaves the disk, with vLLM's own block
hashes."""

import pytest
from engine import engine, generate, random_prompt

pytestmark = pytest.mark.engine


def test_kv_events_announce_disk_blocks_with_the_engines_own_hashes(tiny_model, tmp_path):
    from vllm.config.kv_events import KVEventsConfig

    kv = str(tmp_path / "kv")
    prompt = random_prompt(1000, seed=63)
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    with engine(
        tiny_model,
        kv,
        llm_args={"kv_events_config": cfg},
        kv_disk_space_mb=4,
        kv_disk_min_free_mb=0,
    ) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        batches = []
        scheduler.kv_event_publisher.publish = batches.append  # what a router would receive
        generate(llm, prompt)
        generate(llm, random_prompt(300, seed=64))  # one more step: the report lands
        for seed in range(65, 68):  # ~2.6 MB each against a 4 MiB budget: evictions
            generate(llm, random_prompt(1000, seed=seed))
            generate(llm, random_prompt(300, seed=seed + 10))
    found = [e for b in batches for e in b.events]
    gpu = {
        h
        for e in found
        if type(e).__name__ == "BlockStored" and e.medium == "GPU"
        for h in e.block_hashes
    }
    disk = [e for e in found if type(e).__name__ == "BlockStored" and e.medium == "STORAGE"]
    assert disk, [type(e).__name__ for e in found]
    first = disk[0]
    assert first.block_size == 128 and len(first.block_hashes) == 896 // 128
    assert first.token_ids == prompt[:896] and first.parent_block_hash is None
    assert set(first.block_hashes) <= gpu  # the same hashes vLLM gives these blocks
    removed = [e for e in found if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE"]
    assert removed and set(removed[0].block_hashes) <= {h for e in disk for h in e.block_hashes}
