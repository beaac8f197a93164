"""Save jobs: the positions the save rules made due, turned into checkpoints to write.

Each due position of a request is planned as a delta on the deepest checkpoint on disk or
in flight (``planner``), reserved in the index (two-phase: a reserved key is a parent and
a duplicate for the next plans, never a lookup hit) and handed to the workers as a
:class:`SaveJob` with the engine blocks it stores, per KV cache group.

Invariants:
* A plan is all or nothing: when planning a request's positions raises, none of its
  jobs queued by that plan stays queued and their reservations are released (the caller
  may answer vLLM that nothing is saved, and vLLM then frees the blocks).
* ``drop`` takes back every queued job of a request: a job leaves only in ``take``.
* Each position is planned on its own: one past the request's known token ids is left
  out, never the positions below it.
"""

from __future__ import annotations

import time

from vllm_kvdisk.connector.events import DiskEvents
from vllm_kvdisk.connector.groupblocks import GroupBlocks
from vllm_kvdisk.connector.jobs import SaveJob
from vllm_kvdisk.core.control import tool_entries
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.lifecycle import RequestState
from vllm_kvdisk.core.planner import Planner, Prompt
from vllm_kvdisk.core.saverules import SaveRules
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.storage.store import Store


class SavePlanning:
    def __init__(
        self,
        *,
        planner: Planner,
        rules: SaveRules,
        table: TokenTable,
        blocks: GroupBlocks,
        events: DiskEvents,
        store: Store,
        context_size: int,
        workers: int,
    ):
        self.planner, self.rules, self.table, self.blocks = planner, rules, table, blocks
        self.events, self.store = events, store
        self.block_size = blocks.block_size
        self.context_size = context_size
        self.workers = workers  # every worker confirms each save job's copy once
        self.jobs: list[SaveJob] = []  # planned in this step, for the step's metadata

    def take(self) -> list[SaveJob]:
        jobs, self.jobs = self.jobs, []
        return jobs

    def drop(self, st: RequestState, since: int = 0) -> None:
        """Take back the request's jobs queued from index ``since`` on, releasing their
        reservations: they will never be copied."""
        req_id = st.request.request_id
        kept = self.jobs[:since]
        for job in self.jobs[since:]:
            if job.req_id != req_id:
                kept.append(job)
                continue
            self.store.index.release(job.plan.ns, job.plan.sha1)
            self.events.dropped((job.plan.ns, job.plan.sha1))
            st.copies_out -= self.workers
        self.jobs = kept

    def plan(
        self,
        st: RequestState,
        due: list[tuple[int, Reason]],
        group_ids: list[list[int]],
        states: dict[int, int] | None = None,
    ) -> bool:
        """Plan the due saves of one request (``group_ids``: its block ids, one list per
        KV cache group; ``states``: per state group, the block holding the state at the
        one due position); True if any was planned. All or nothing: if it raises, no job
        of this plan is queued."""
        since = len(self.jobs)
        try:
            return self._plan(st, due, group_ids, states)
        except Exception:
            self.drop(st, since)
            raise

    def _plan(
        self,
        st: RequestState,
        due: list[tuple[int, Reason]],
        group_ids: list[list[int]],
        states: dict[int, int] | None,
    ) -> bool:
        block_ids = self.blocks.main(group_ids)
        request = st.request
        cap = st.control.max_save_tokens
        if cap is not None and states is not None:  # a state is kept at its own position
            due = [
                (length, reason)
                for length, reason in due  # only: none at the cap
                if length <= self.rules.grid.block_floor(cap)
            ]
        elif cap is not None:  # positions past the cap become one checkpoint at the cap
            at_cap = self.rules.grid.block_floor(cap)
            due = sorted(
                {
                    (min(length, at_cap), reason)
                    for length, reason in due
                    if min(length, at_cap) >= self.rules.min_tokens
                }
            )
        # A position past the known ids (tokens in flight under async scheduling or
        # speculative decoding) is dropped alone; the positions below it are planned.
        known = len(request.all_token_ids)
        due = [(length, reason) for length, reason in due if length <= known]
        if not due or not st.control.save:
            return False
        top = max(length for length, _ in due)
        prompt = Prompt(self.table, request.all_token_ids[:top])
        planned = False
        for length, reason in due:
            plan = self.planner.plan_save(st.ns, prompt, length, reason)
            if plan is None:
                continue
            bs = self.block_size
            owned = block_ids[plan.parent_tokens // bs : length // bs]
            if len(owned) != (length - plan.parent_tokens) // bs:
                continue
            stored: list[list[int]] = []
            if self.blocks.hybrid:
                stored = (
                    self.blocks.stored(
                        group_ids, plan.parent_tokens, length, states, plan.window_held
                    )
                    or []
                )
                if not stored:  # the window before this position is gone already
                    continue
                owned = stored[0]
            if not self.planner.reserve(plan, prompt, int(time.time())):
                continue
            try:
                self.events.planned(
                    (plan.ns, plan.sha1), request, plan.parent_tokens, length, st.scope.lora
                )
                text = prompt.text_upto(length)
                self.jobs.append(
                    SaveJob(
                        request.request_id,
                        st.scope,
                        plan,
                        list(owned),
                        text,
                        prompt.ids[:length].astype("<u4").tobytes(),
                        self.context_size,
                        tool_map=tool_entries(st.control, text),
                        groups=stored,
                    )
                )
                st.copies_out += self.workers
            except Exception:
                # A reservation nobody will report keeps has_pending_push_work() true and
                # the engine stepping empty batches forever: give it back first.
                self.store.index.release(plan.ns, plan.sha1)
                self.events.dropped((plan.ns, plan.sha1))
                raise
            planned = True
        return planned
