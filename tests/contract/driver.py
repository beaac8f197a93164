"""A real vLLM scheduler with kvdisk as its connector, driven step by step with
synthesised workers: the version-neutral half of the contract tests (``vllm_api`` holds
what depends on vLLM's version).

Each simulated TP rank follows the worker half's protocol (``connector/worker.py``): it
starts the step's loads and page copies, completes a preempted request's copies before
the forward (``flush``), reports a finished load in ``finished_recving`` (with its bad
blocks in ``invalid_block_ids`` and the request in ``WorkerReport.failed_loads``, in the
same step; rank 0, whose namespace the scheduler indexes, also reports the chain's last
file stale, as a load that found it corrupt does), each copy in ``WorkerReport.copied``,
and a held request in ``finished_sending`` once none of its copies runs. Its saves are
reported failed (no file is written), which releases their reservations. The ranks'
outputs go through vLLM's own ``KVOutputAggregator``.

What it checks, after every action that may free blocks (``schedule``,
``update_from_output``, an abort): every page copy and every load still running reads or
writes only blocks vLLM still holds for its request, and no copy reads a block a load on
any rank is still writing. A violation raises :class:`FreedBlockRead`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import vllm_api as api

from vllm_kvdisk.connector.jobs import LoadJob, SaveJob, WorkerReport
from vllm_kvdisk.core.encode import encode_plan
from vllm_kvdisk.core.format import PageLayout, Reason
from vllm_kvdisk.core.planner import Prompt


class FreedBlockRead(AssertionError):
    """A copy or a load touched a block vLLM no longer holds for its request."""


# (request id, rank) -> (steps the load takes on that rank, its bad block ids)
LoadPlan = Callable[[LoadJob, int], tuple[int, list[int]]]


def instant_loads(job: LoadJob, rank: int) -> tuple[int, list[int]]:
    return 1, []


@dataclass
class Copy:
    job: SaveJob
    steps: int


@dataclass
class Rank:
    index: int
    loads: dict[str, tuple[LoadJob, int, list[int]]] = field(default_factory=dict)
    copies: list[Copy] = field(default_factory=list)
    held: set[str] = field(default_factory=set)
    done: list[Copy] = field(default_factory=list)  # copies ended early, reported at finish

    def start(self, meta, plan: LoadPlan, copy_steps: int) -> None:
        for copy in self.copies:  # handle_preemptions: these copies end before the forward
            if copy.job.req_id in meta.flush:
                copy.steps = 0
        self.done += [c for c in self.copies if c.steps == 0]
        self.copies = [c for c in self.copies if c.steps > 0]
        for job in meta.loads:
            steps, bad = plan(job, self.index)
            self.loads[job.req_id] = (job, steps, bad)
        self.copies += [Copy(job, copy_steps) for job in meta.saves]
        self.held.update(meta.holds)

    def finish(self) -> api.KVConnectorOutput:
        report = WorkerReport()
        recving: set[str] = set()
        invalid: set[int] = set()
        for req_id, (job, steps, bad) in list(self.loads.items()):
            if steps > 1:
                self.loads[req_id] = (job, steps - 1, bad)
                continue
            del self.loads[req_id]
            recving.add(req_id)
            if bad:
                invalid.update(bad)
                report.failed_loads.append(req_id)
                if self.index == 0 and job.files:  # rank 0's namespace is the indexed one
                    report.stale.append((job.indexed_ns, job.files[-1].sha1))
        running = []
        for copy in self.copies:
            copy.steps -= 1
            if copy.steps > 0:
                running.append(copy)
            else:
                self.done.append(copy)
        for copy in self.done:
            report.copied.append(copy.job.req_id)
            report.failed_saves.append((copy.job.plan.ns, copy.job.plan.sha1))
        self.copies, self.done = running, []
        copying = {c.job.req_id for c in self.copies}
        sending = {r for r in self.held if r not in copying}
        self.held -= sending
        return api.kv_output(
            sending=sending, recving=recving, invalid=invalid, meta=report if report else None
        )


class Engine:
    """vLLM's scheduler with kvdisk, ``tp`` simulated ranks and vLLM's aggregator.
    ``depth`` 2 runs the steps the way async scheduling does: a step is scheduled before
    the previous one's output is applied."""

    def __init__(
        self,
        scheduler,
        tp: int = 1,
        *,
        loads: LoadPlan = instant_loads,
        copy_steps: int = 1,
        depth: int = 1,
    ):
        self.s = scheduler
        self.kvdisk = api.kvdisk(scheduler)
        self.ranks = [Rank(i) for i in range(tp)]
        self.aggregator = api.aggregator(tp)
        self.plan_loads = loads
        self.copy_steps = copy_steps
        self.depth = depth
        self.queue: collections.deque = collections.deque()
        self.saves: list[SaveJob] = []  # every save job shipped
        self.steps = 0
        self.finished: dict[str, bool] = {}  # request_finished's answer (delay_free) per request
        connector = scheduler.connector
        for hook in ("request_finished", "request_finished_all_groups"):
            setattr(connector, hook, self._spy(getattr(connector, hook)))

    def _spy(self, hook):
        def call(request, block_ids):
            delay_free, params = hook(request, block_ids)
            self.finished[request.request_id] = delay_free
            return delay_free, params

        return call

    # -- driving --------------------------------------------------------------------
    def add(self, request) -> None:
        self.s.add_request(request)

    def step(self) -> None:
        out = self.s.schedule()
        meta = out.kv_connector_metadata
        for rank in self.ranks:
            rank.start(meta, self.plan_loads, self.copy_steps)
        self.saves += meta.saves
        self.check("schedule")
        outputs = [api.runner_output(out, rank.finish()) for rank in self.ranks]
        self.queue.append((out, outputs))
        while len(self.queue) >= self.depth:
            self.apply()
        self.steps += 1

    def apply(self) -> None:
        out, outputs = self.queue.popleft()
        self.s.update_from_output(out, self.aggregator.aggregate(outputs))
        self.check("update_from_output")

    def abort(self, req_id: str) -> None:
        api.abort(self.s, req_id)
        self.check("abort")

    def shutdown_signal(self) -> None:
        self.kvdisk._stop_requested()

    def run(self, until: Callable[[], bool], limit: int = 200) -> None:
        for _ in range(limit):
            if until():
                return
            self.step()
        raise AssertionError(f"not reached in {limit} steps")

    def drain(self, limit: int = 200) -> None:
        """Step until vLLM holds no request and no rank has work left."""

        def idle() -> bool:
            if self.s.requests or any(r.loads or r.copies or r.held for r in self.ranks):
                return False
            while self.queue:  # the outputs of steps in flight (async scheduling)
                self.apply()
            return not self.s.requests

        self.run(idle, limit)

    # -- the invariant ----------------------------------------------------------------
    def check(self, when: str) -> None:
        loading: dict[int, str] = {}
        for rank in self.ranks:
            for req_id, (job, _, _) in rank.loads.items():
                self._owned(req_id, job.block_ids, f"a load on rank {rank.index}", when)
                loading.update((b, req_id) for b in job.block_ids)
        for rank in self.ranks:
            for copy in rank.copies:
                job = copy.job
                for group, blocks in enumerate(job.groups or [job.block_ids]):
                    what = f"a copy on rank {rank.index}"
                    self._owned(job.req_id, blocks, what, when, group)
                clash = sorted(b for b in job.block_ids if b in loading)
                if clash:
                    raise FreedBlockRead(
                        f"after {when}: a copy of {job.req_id} reads blocks {clash} "
                        f"that a load of {loading[clash[0]]} is still writing"
                    )

    def _owned(self, req_id: str, blocks: list[int], what: str, when: str, group: int = 0) -> None:
        held = api.owned_blocks(self.s, req_id, group)
        if group in self.kvdisk.states.state_groups:  # or pinned by kvdisk for the request
            held |= self.pinned(req_id)
        lost = sorted(set(blocks) - held)
        if lost:
            raise FreedBlockRead(
                f"after {when}: {what} of {req_id} uses blocks {lost} vLLM has freed"
            )

    def pinned(self, req_id: str) -> set[int]:
        """State blocks kvdisk pins for a request (its newest boundary, or until its
        finished_sending)."""
        states = self.kvdisk.states
        newest = states._newest.get(req_id, (0, {}))[1].values()
        after = states._after_finish.get(req_id, [])
        return {b.block_id for b in [*newest, *after]}


def seed_checkpoint(engine: Engine, prompt: list[int], tokens: int) -> None:
    """Put a checkpoint of ``prompt[:tokens]`` on disk (pages of zeros) and in kvdisk's
    index, as a previous run would have left it."""
    side = engine.kvdisk
    ns = side.store.ensure_namespace(side.base_fp)
    ids = np.asarray(prompt, dtype="<u4")
    p = Prompt(side.table, ids)
    plan = side.planner.plan_save(ns, p, tokens, Reason.COLD)
    assert plan is not None, "nothing to seed"
    bs = side.block_size
    layout = PageLayout(side.base_fp.layout, bs, 4, (1, bs, 128), "float32")
    pages = [bytes((tokens - plan.parent_tokens) // bs * layout.page_bytes)] * 4
    data = encode_plan(
        plan,
        text=p.text_upto(tokens),
        ids=p.ids,
        layers=pages,
        layout=layout,
        fingerprint=side.base_fp.digest(),
        kv_dtype="float32",
        context_size=8192,
        now=1_000_000,
    )
    side.store.write(ns, plan.sha1, data)
