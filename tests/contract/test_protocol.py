"""kvdisk's save/load protocol against a real vLLM scheduler (``vllm_api``), stepped with
synthesised TP ranks whose outputs vLLM's own ``KVOutputAggregator`` combines (``driver``).
The driver raises if a page copy or a load touches a block vLLM has freed; vLLM's scheduler
raises (AssertionError) if the connector breaks its side of the protocol."""

from __future__ import annotations

import pytest
import vllm_api as api
from driver import seed_checkpoint

from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.lifecycle import Phase

PROMPT = list(range(100, 300))  # 200 tokens; a checkpoint of its first 160 is seeded
OTHER = PROMPT[:150] + list(range(1000, 1100))  # shares 150 tokens: a hit of 144


def rank0_fails_rank1_slow(job, rank):
    """Rank 0 ends the load at once with its last block bad; rank 1 takes 6 steps."""
    return (1, job.block_ids[-1:]) if rank == 0 else (6, [])


def loading_with_rank0_failed(make_engine):
    """TP = 2: a request whose load failed on rank 0 while rank 1 still loads, and whose
    checkpoint was removed meanwhile (``reset_cache``: the operator's reset), so its
    computed prefix is not on disk any more: a save of it would be planned if allowed."""
    e = make_engine(2, loads=rank0_fails_rank1_slow)
    seed_checkpoint(e, PROMPT, 160)
    r = api.make_request(OTHER, max_tokens=4)
    e.add(r)
    e.step()  # admitted with a hit of 144: the load job goes to both ranks
    e.step()  # rank 0 reports its failure (vLLM truncates the request to 128 tokens)
    assert api.is_loading(e.s, r.request_id) and r.num_computed_tokens == 128
    e.kvdisk.reset_cache()
    return e, r


def test_tp2_a_ranks_failed_load_then_an_abort_frees_nothing_a_rank_still_loads(make_engine):
    """The request stayed in vLLM's WAITING_FOR_REMOTE_KVS, but kvdisk had moved it to
    FAILED on rank 0's report: the abort planned an evict save over blocks rank 1 was
    still writing and held them, the copy's finished_sending freed the request, and rank
    1's finished_recving then tripped vLLM's ``assert req_id in self.requests``."""
    e, r = loading_with_rank0_failed(make_engine)
    e.abort(r.request_id)
    assert e.finished[r.request_id] is False  # released by its finished_recving only
    assert not [j for j in e.saves + e.kvdisk.saves.jobs if j.req_id == r.request_id]
    e.drain()  # rank 1 finishes its load; vLLM frees the blocks then
    assert not e.s.requests and api.all_blocks_free(e.s)
    assert not e.kvdisk.store.index.has_pending() and not e.kvdisk.has_pending_push_work()


def test_tp2_a_shutdown_while_a_rank_still_loads_copies_none_of_its_blocks(make_engine):
    e, r = loading_with_rank0_failed(make_engine)
    e.shutdown_signal()
    e.step()  # the shutdown saves are planned in this step
    assert not [j for j in e.saves if j.req_id == r.request_id]
    e.run(lambda: not any(r.request_id in rank.loads for rank in e.ranks))
    # The failure is applied with the finished_recving vLLM delivered: never loads again.
    st = e.kvdisk._reqs[r.request_id]
    assert st.phase is Phase.FAILED and not st.may_load and st.may_save
    e.drain()
    assert api.all_blocks_free(e.s)


def test_tp2_the_failure_reaches_the_request_only_with_vllms_finished_recving(make_engine):
    e, r = loading_with_rank0_failed(make_engine)
    st = e.kvdisk._reqs[r.request_id]
    while any(r.request_id in rank.loads for rank in e.ranks):
        assert st.phase is Phase.LOADING and not st.may_save and not st.computing
        e.step()
    assert st.phase is Phase.FAILED
    e.drain()
    assert api.all_blocks_free(e.s)


def test_a_finish_whose_save_planning_fails_leaves_no_job_over_the_freed_blocks(
    make_engine, monkeypatch
):
    """Injected fault: planning the second evict position raises. The guard answered
    (False, None) and vLLM freed the blocks, but the first position's job stayed queued:
    the next step copied pages another request was given (a checkpoint of another
    request's KV with valid checksums)."""
    e = make_engine()
    r = api.make_request(PROMPT[:100], max_tokens=60)  # finishes with 159 tokens computed
    e.add(r)
    plan_save = e.kvdisk.planner.plan_save

    def flaky(ns, prompt, length, reason, spine=None):
        if reason is Reason.EVICT and length == 144:  # the evict tail; 128 was planned
            raise OSError("injected")
        return plan_save(ns, prompt, length, reason, spine)

    monkeypatch.setattr(e.kvdisk.planner, "plan_save", flaky)
    e.run(lambda: r.request_id in e.finished)
    assert e.finished[r.request_id] is False
    assert not [j for j in e.kvdisk.saves.jobs if j.req_id == r.request_id]
    assert not e.kvdisk.store.index.has_pending()  # the reservation at 128 given back
    e.drain()  # no copy of the freed blocks
    assert api.all_blocks_free(e.s)


def test_async_a_continued_save_due_past_the_known_ids_is_planned_a_step_later(make_engine):
    """Async scheduling: when a decode step crosses a grid position (trim 0), the token
    in flight is counted as computed but not yet in all_token_ids. The whole plan was
    dropped: every decode-time continued save was lost."""
    e = make_engine(async_scheduling=True, kv_cache_continued_interval_tokens=64)
    r = api.make_request(PROMPT[:100], max_tokens=60)
    e.add(r)
    e.drain()
    saved = sorted((j.plan.tokens, j.plan.reason) for j in e.saves)
    assert (128, Reason.CONTINUED) in saved, saved
    assert api.all_blocks_free(e.s)


def test_async_a_position_past_the_known_ids_drops_only_itself(make_engine):
    """Speculative decoding counts draft tokens as computed before their ids are known:
    a plan whose furthest position is past the known ids was dropped whole."""
    e = make_engine(async_scheduling=True)
    r = api.make_request(PROMPT[:100], max_tokens=80)
    e.add(r)
    e.run(lambda: r.num_computed_tokens >= 150)
    st = e.kvdisk._reqs[r.request_id]
    known = len(r.all_token_ids)
    assert 128 <= known < 160
    assert e.kvdisk._plan(st, [(128, Reason.EVICT), (160, Reason.EVICT)])
    assert [j.plan.tokens for j in e.kvdisk.saves.jobs] == [128]
    e.drain()
    assert api.all_blocks_free(e.s)


@pytest.mark.parametrize(
    "control", [{"save": False}, {"max_save_tokens": 48}], ids=["save-false", "past-the-cap"]
)
def test_a_state_is_pinned_only_where_a_save_could_be_made(make_engine, control):
    """A Mamba / linear-attention state vLLM hands over was pinned for every request, one
    block per state group each, also for requests that never save there."""
    e = make_engine(state_group=True)
    r = api.make_request(PROMPT[:100], max_tokens=20, kv_transfer_params={"kvdisk": control})
    e.add(r)
    for _ in range(25):
        e.step()
        assert e.kvdisk.states.pinned == 0
    e.drain()
    assert not e.saves and api.all_blocks_free(e.s)


def test_a_state_pin_is_kept_for_a_save_below_the_cap(make_engine):
    e = make_engine(state_group=True)
    r = api.make_request(PROMPT[:100], max_tokens=20, kv_transfer_params={"kvdisk": {}})
    e.add(r)
    e.step()
    assert e.kvdisk.states.boundary(r.request_id)[0] == 96  # the prompt's last whole block
    e.drain()
    assert [(j.plan.tokens, j.plan.reason) for j in e.saves][:1] == [(96, Reason.COLD)]


def test_a_preempted_request_keeps_no_state_pin_while_it_waits(make_engine):
    e = make_engine(state_group=True, num_blocks=24)  # three requests do not fit: preemptions
    for i in range(3):
        e.add(api.make_request(PROMPT[i * 10 : i * 10 + 100], max_tokens=60))
    waited = 0
    for _ in range(200):
        if not e.s.requests:
            break
        e.step()
        for req_id in api.preempted(e.s):
            waited += 1
            assert e.kvdisk.states.boundary(req_id) is None, req_id
    assert waited  # preemptions happened
    e.drain()
    assert e.kvdisk.states.pinned == 0 and api.all_blocks_free(e.s)
