"""kvdisk inside the installed vLLM's own ``Scheduler``: each test drives requests through
one part of the connector contract with synthesised workers (``driver``) and checks what
vLLM did with kvdisk's answers. The engine's invariant (no copy or load touches a block
vLLM has freed) is checked after every action; the tests add what each path must end in.
"""

import pytest
import vllm_api as api
from driver import FreedBlockRead, seed_checkpoint

PROMPT = list(range(100, 300))  # 200 tokens: 12 whole blocks of 16
BS = 16


def test_a_disk_hit_loads_asynchronously_and_only_the_tail_is_computed(make_engine):
    engine = make_engine()
    seed_checkpoint(engine, PROMPT, 128)
    request = api.make_request(PROMPT, max_tokens=4)
    engine.add(request)
    engine.step()
    # kvdisk answered (72 tokens, asynchronous): vLLM parks the request while it loads.
    assert api.is_loading(engine.s, request.request_id)
    assert [(j.req_id, j.start_block, len(j.block_ids)) for j in engine.loads] == [
        (request.request_id, 0, 128 // BS)
    ]
    assert engine.loads[0].block_ids == api.block_table(engine.s, request.request_id)[:8]
    assert engine.scheduled[0].get(request.request_id, 0) == 0  # nothing computed yet
    engine.run(lambda: scheduled(engine, request))
    # After the load: the prompt's tail only, from the block the file ends at.
    assert engine.scheduled[-1][request.request_id] == len(PROMPT) - 128
    engine.drain()
    assert request.is_finished() and len(request.output_token_ids) == 4
    assert kvdisk_forgot(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_load_recomputes_from_the_bad_block_and_never_loads_again(
    make_engine, async_scheduling
):
    """Rank 0 loses the load's last block, rank 1 finishes later: vLLM recomputes from the
    lost block on, and kvdisk does not offer the disk to that request again."""

    def loads(job, rank):
        return (1, job.block_ids[-1:]) if rank == 0 else (3, [])

    engine = make_engine(2, loads=loads, async_scheduling=async_scheduling)
    seed_checkpoint(engine, PROMPT, 128)
    request = api.make_request(PROMPT, max_tokens=4)
    engine.add(request)
    engine.run(lambda: scheduled(engine, request))
    # Blocks 0..6 arrived; block 7 (tokens 112..127) is recomputed with the tail.
    assert engine.scheduled[-1][request.request_id] == len(PROMPT) - 7 * BS
    engine.drain()
    assert request.is_finished()
    assert [j.req_id for j in engine.loads] == [request.request_id]  # one load, no retry
    assert kvdisk_forgot(engine)


def test_a_request_whose_load_failed_is_not_loaded_again_after_preemption(make_engine):
    """The failed load comes back in kvdisk's worker report: kvdisk never offers that
    request the disk again, also when vLLM preempts it and looks it up anew (here vLLM's
    own reset of the prefix cache, which preempts every running request)."""
    engine = make_engine(2, loads=lambda job, rank: (1, job.block_ids[-1:]))
    seed_checkpoint(engine, PROMPT, 128)
    request = api.make_request(PROMPT, max_tokens=20)
    engine.add(request)
    engine.run(lambda: len(request.output_token_ids) >= 2)
    engine.reset_prefix_cache()
    assert not api.is_running(engine.s, request.request_id)  # preempted
    engine.drain()
    assert request.is_finished()
    assert [j.req_id for j in engine.loads] == [request.request_id]


def test_a_request_preempted_while_its_pages_are_copied_waits_for_the_copies(make_engine):
    """vLLM preempts a request whose save is still copying and reuses its blocks at once:
    kvdisk names it in the step's ``flush`` so the workers finish those copies before the
    forward that overwrites them (``handle_preemptions``)."""
    engine = make_engine(copy_steps=3, num_blocks=30, max_tokens_per_step=512)
    first = api.make_request(PROMPT, max_tokens=120)
    second = api.make_request([t + 1000 for t in PROMPT], max_tokens=120)
    engine.add(first)
    engine.add(second)
    engine.drain(limit=600)
    assert engine.preempted, "the scenario no longer preempts a request"
    assert set(engine.preempted) <= {r for m in engine.metas for r in m.flush}
    assert first.is_finished() and second.is_finished()
    assert kvdisk_forgot(engine)
    assert api.free_blocks(engine.s) == engine.blocks_at_start


def test_a_request_finishing_while_its_save_is_copied_keeps_its_blocks(make_engine):
    """A save planned as a request finishes is copied in a later step: kvdisk holds the
    request's blocks (``request_finished`` -> delay free) until every worker names it
    in ``finished_sending``, then vLLM frees them."""
    engine = make_engine(2, copy_steps=3)
    request = api.make_request(PROMPT, max_tokens=2)
    engine.add(request)
    engine.run(lambda: request.is_finished())
    assert engine.saves and request.request_id in engine.kvdisk._held
    held = api.owned_blocks(engine.s, request.request_id)
    assert held  # still vLLM's, for the copies
    engine.drain()
    assert api.owned_blocks(engine.s, request.request_id) == set()
    assert not engine.kvdisk._held and kvdisk_forgot(engine)
    assert api.free_blocks(engine.s) == engine.blocks_at_start
    # A request that saves nothing (shorter than a checkpoint) is not held at all.
    short = api.make_request(PROMPT[:20], max_tokens=2)
    engine.add(short)
    engine.run(lambda: short.is_finished())
    assert api.owned_blocks(engine.s, short.request_id) == set()


@pytest.mark.parametrize("when", ["loading", "running"])
def test_an_aborted_request_gives_every_block_back(make_engine, when):
    """Aborted mid-load, vLLM keeps the blocks until the load reports (kvdisk must not
    hold them for a save); aborted while running, kvdisk's held copy ends first."""
    engine = make_engine(2, loads=lambda job, rank: (4, []), copy_steps=2)
    seed_checkpoint(engine, PROMPT, 128)
    request = api.make_request(PROMPT, max_tokens=50)
    engine.add(request)
    engine.step()
    assert api.is_loading(engine.s, request.request_id)
    if when == "running":
        engine.run(lambda: len(request.output_token_ids) >= 2)
    engine.abort(request.request_id)
    engine.drain()
    assert request.request_id not in engine.s.requests
    assert api.owned_blocks(engine.s, request.request_id) == set()
    assert kvdisk_forgot(engine) and not engine.kvdisk._held
    assert api.free_blocks(engine.s) == engine.blocks_at_start


def test_a_disk_hit_starts_loading_while_the_batch_is_full_where_vllm_allows_it(make_engine):
    """vLLM 0.33+ with ``--max-num-inflight-kv-loads``: kvdisk says its loads are
    asynchronous (``may_load_async``), so a request with a disk hit starts its load while
    the only running slot is taken. vLLM 0.32 has no such admission: it waits."""
    engine = make_engine(max_num_seqs=1, max_num_inflight_kv_loads=2)
    seed_checkpoint(engine, PROMPT, 128)
    busy = api.make_request([t + 1000 for t in PROMPT], max_tokens=30)
    engine.add(busy)
    engine.step()
    waiting = api.make_request(PROMPT, max_tokens=2)
    engine.add(waiting)
    engine.step()
    loaded_early = [j.req_id for j in engine.loads] == [waiting.request_id]
    assert loaded_early == api.HAS_INFLIGHT_KV_LOADS
    assert not busy.is_finished()
    engine.drain()
    assert waiting.is_finished() and kvdisk_forgot(engine)


def test_a_hybrid_models_state_is_pinned_from_its_hand_off_until_its_copy_ends(make_engine):
    """A Mamba state group in vLLM's align mode: vLLM hands over the state at the prompt's
    last whole block once and frees it a step later. kvdisk pins it in vLLM's block pool
    (``touch``) and saves it with the attention blocks before it; the pin outlives the
    request until its copy is reported, then every block is vLLM's again."""
    engine = make_engine(2, copy_steps=3, state_group=True)
    request = api.make_request(PROMPT, max_tokens=3)
    engine.add(request)
    engine.step()
    boundary = engine.kvdisk.states.boundary(request.request_id)
    assert boundary is not None and boundary[0] == 192  # 12 whole blocks of 16
    (state_block,) = boundary[1].values()
    tables = api.block_tables(engine.s, request.request_id)
    assert tables[0][11] == state_block  # the state after token 192, in vLLM's table
    engine.step()
    (save,) = engine.saves
    assert save.plan.tokens == 192 and save.groups == [[state_block], tables[1][:12]]
    engine.run(lambda: request.is_finished())  # vLLM moved on: only the pin holds it
    engine.drain()
    assert engine.kvdisk.states.pinned == 0
    assert api.free_blocks(engine.s) == engine.blocks_at_start
    assert kvdisk_forgot(engine)


def test_a_state_handed_over_a_step_before_the_save_is_still_there_to_copy(make_engine):
    """Chunked prefill of 300 tokens, 128 a step: vLLM hands over the states at 128 and
    256 and frees each a step later; the save due when the prompt completes (step 3) is
    made at the newest boundary, 256, whose block only kvdisk's pin still holds."""
    engine = make_engine(state_group=True, max_tokens_per_step=128)
    prompt = list(range(100, 400))
    request = api.make_request(prompt, max_tokens=2)
    engine.add(request)
    engine.run(lambda: bool(engine.saves))
    (save,) = engine.saves
    assert save.plan.tokens == 256 and len(engine.scheduled) == 3
    (state_block,) = save.groups[0]
    assert state_block not in api.block_tables(engine.s, request.request_id)[0]  # vLLM's: gone
    engine.drain()
    assert engine.kvdisk.states.pinned == 0
    assert api.free_blocks(engine.s) == engine.blocks_at_start


def test_sleep_mode_is_refused_at_start_up(tiny_model, tmp_path):
    """kvdisk does not follow sleep mode's KV cache remap: vLLM 0.33+ refuses the pair
    while it builds its config, from ``supports_sleep_mode``, before any connector
    exists; on 0.32, which does not ask, kvdisk's own start-up check refuses it."""
    with pytest.raises(ValueError) as refused:
        sched = api.make_scheduler(tiny_model, str(tmp_path / "kv"), enable_sleep_mode=True)
        api.kvdisk(sched).shutdown()
    expected = "kvdisk does not support sleep mode" if api.HAS_SLEEP_MODE_HOOK else "kvdisk: "
    assert expected in str(refused.value)


def scheduled(engine, request) -> bool:
    """Did the last step compute tokens of ``request``?"""
    return bool(engine.scheduled and engine.scheduled[-1].get(request.request_id))


def kvdisk_forgot(engine) -> bool:
    """kvdisk keeps no state for requests vLLM no longer has."""
    return not (set(engine.kvdisk._reqs) - set(engine.s.requests))


def test_the_invariant_check_catches_a_freed_block(make_engine):
    """The driver's check itself: a copy of blocks vLLM no longer holds is reported."""
    engine = make_engine(copy_steps=5)
    request = api.make_request(PROMPT, max_tokens=2)
    engine.add(request)
    engine.run(lambda: bool(engine.ranks[0].copies))
    engine.ranks[0].copies[0].job.block_ids.append(10_000)
    with pytest.raises(FreedBlockRead):
        engine.check("test")


def test_one_requests_failing_save_plan_leaves_the_other_requests_saves(make_engine):
    """Planning a save is per request: an error in one request's plan (counted, logged)
    never drops the saves of the others scheduled in the same step."""
    engine = make_engine()
    sched = engine.kvdisk
    broken = api.make_request(PROMPT, max_tokens=2)
    other = api.make_request([t + 1000 for t in PROMPT], max_tokens=2)
    plan = sched._plan

    def failing(st, due):
        if st.request.request_id == broken.request_id:
            raise RuntimeError("injected planning fault")
        return plan(st, due)

    counted = []
    count = sched.stats.count
    sched.stats.count = lambda name, label, value=1: (
        counted.append((name, label)),
        count(name, label, value),
    )
    sched._plan = failing
    engine.add(broken)
    engine.add(other)
    engine.step()
    assert engine.scheduled[0].keys() == {broken.request_id, other.request_id}
    saved = {job.req_id for job in engine.saves}
    assert other.request_id in saved and broken.request_id not in saved
    assert ("errors", "build_connector_meta") in counted
    engine.drain()
    assert broken.is_finished() and other.is_finished()
    assert kvdisk_forgot(engine)
