"""The protocol as a property: with TP = 2 simulated through vLLM's KVOutputAggregator, no
sequence of per-rank load outcomes (slow, failed in part or whole), aborts, shutdowns and
cache resets makes vLLM's scheduler assert or lets a page copy or a load touch a block
vLLM has freed (``driver.FreedBlockRead``); and the engine ends with every block back,
no reservation pending and nothing held."""

from __future__ import annotations

import tempfile

import vllm_api as api
from driver import Engine, seed_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROMPT = list(range(100, 300))
PROMPTS = (
    PROMPT,  # a hit of 160 (the seeded chain 0-64-160)
    PROMPT[:150] + list(range(1000, 1100)),  # a hit of 144
    PROMPT[:70] + list(range(2000, 2090)),  # a hit of 64
    list(range(3000, 3180)),  # a miss
)
BAD = ("none", "last", "last", "first", "all")

rank_load = st.tuples(st.integers(1, 5), st.sampled_from(BAD))
request = st.fixed_dictionaries(
    {
        "prompt": st.integers(0, len(PROMPTS) - 1),
        "max_tokens": st.integers(1, 40),
        "arrives": st.integers(0, 3),
        "ranks": st.tuples(rank_load, rank_load),
    }
)
action = st.tuples(
    st.integers(0, 9), st.sampled_from(("abort", "abort", "shutdown", "reset")), st.integers(0, 3)
)


def bad_blocks(blocks: list[int], mode: str) -> list[int]:
    return {"none": [], "last": blocks[-1:], "first": blocks[:1], "all": list(blocks)}[mode]


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    requests=st.lists(request, min_size=1, max_size=4),
    actions=st.lists(action, max_size=8),
    copy_steps=st.integers(1, 3),
    num_blocks=st.sampled_from((40, 400)),
    async_scheduling=st.booleans(),
)
def test_tp2_no_sequence_asserts_in_vllm_or_reads_a_freed_block(
    tiny_model, requests, actions, copy_steps, num_blocks, async_scheduling
):
    with tempfile.TemporaryDirectory() as kv:
        sched = api.make_scheduler(
            tiny_model,
            kv,
            tp=2,
            num_blocks=num_blocks,
            async_scheduling=async_scheduling,
            kv_cache_boundary_align_tokens=64,
            kv_cache_boundary_trim_tokens=0,
            kv_cache_min_tokens=32,
            kv_cache_continued_interval_tokens=64,
        )
        outcomes: dict[str, tuple] = {}

        def loads(job, rank):
            steps, mode = outcomes[job.req_id][rank]
            return steps, bad_blocks(job.block_ids, mode)

        e = Engine(sched, 2, loads=loads, copy_steps=copy_steps, depth=2 if async_scheduling else 1)
        try:
            seed_checkpoint(e, PROMPT, 64)
            seed_checkpoint(e, PROMPT, 160)
            made = []
            for i, spec in enumerate(requests):
                r = api.make_request(
                    PROMPTS[spec["prompt"]], max_tokens=spec["max_tokens"], req_id=f"q{i}"
                )
                outcomes[r.request_id] = spec["ranks"]
                made.append((spec["arrives"], r))
            for step in range(24):
                for arrives, r in made:
                    if arrives == step:
                        e.add(r)
                for when, what, which in actions:
                    if when != step:
                        continue
                    if what == "abort":
                        e.abort(made[which % len(made)][1].request_id)
                    elif what == "shutdown":
                        e.shutdown_signal()
                    elif what == "reset":
                        e.kvdisk.reset_cache()
                e.step()
            e.drain(limit=400)
            assert not e.s.requests and api.all_blocks_free(e.s)
            side = e.kvdisk
            assert not side._reqs and not side.saves.jobs
            assert not side.store.index.has_pending() and not side.has_pending_push_work()
        finally:
            e.kvdisk.shutdown()
