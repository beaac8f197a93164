"""Scheduler half of the connector: lookups, load jobs and save jobs.

Runs in vLLM's EngineCore process; each public method is the vLLM hook of the same name
(the facade delegates one line each). It decides from the index (``planner``,
``saverules``, ``policy``: pure, unit-tested), never writes checkpoint files itself (the
worker copies and writes, and its per-step :class:`WorkerReport` tells the index what
landed), and leaves explanations that read files to ``diagnose`` on a background thread.

Invariants:
* ``get_num_new_matched_tokens`` answers from a memo of its own lookup; refreshing the
  index (files other processes wrote or removed; a new file proven corrupt is quarantined
  then) is its only other effect.
* A hit is always block-aligned, beyond what the GPU prefix cache holds, below the full
  prompt, and asynchronous. When a request may load or save is ``lifecycle``'s to say
  (a request whose load failed is never offered the disk again).
* ``request_finished`` answers for every save job of the request: on False (vLLM frees
  the blocks at once) none is queued and their reservations are released; it holds the
  blocks while any copy of the request is unconfirmed. A request with a load out on any
  rank is answered False and never saved (vLLM frees it with its finished_recving).
* Nothing a client or the storage can cause escapes a hook: it is counted
  (``vllm:kvdisk_errors_total{hook}``), logged, and the request is served without the cache.
  A request that was promised a load always gets a load job (possibly one that fails at
  once), so it never waits forever.
* The engine's step never waits for ``ROOT/.lock``: ``reset_cache`` tries it once; a
  namespace whose rename must wait for it is renamed by a thread (``kvdisk-reset``), and
  lookups in it miss meanwhile. (Refreshes in a lookup try the lock once, to quarantine.)
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from vllm_kvdisk.connector.events import DiskEvents
from vllm_kvdisk.connector.groupblocks import GroupBlocks
from vllm_kvdisk.connector.guard import guarded
from vllm_kvdisk.connector.jobs import LoadFile, LoadJob, Scope, StepMeta, WorkerReport
from vllm_kvdisk.connector.objectfetch import ObjectFetches
from vllm_kvdisk.connector.saveplans import SavePlanning
from vllm_kvdisk.connector.signals import on_stop_signal
from vllm_kvdisk.connector.statehandoffs import StateHandoffs
from vllm_kvdisk.core.config import KVDiskConfig
from vllm_kvdisk.core.control import RequestControl
from vllm_kvdisk.core.entry import Key
from vllm_kvdisk.core.format import FULL_ONLY, Group, Reason
from vllm_kvdisk.core.index import Lookup, Miss
from vllm_kvdisk.core.keys import Fingerprint, Namespaces, as_token_array, salt_digest
from vllm_kvdisk.core.lifecycle import Phase, RequestState
from vllm_kvdisk.core.logs import get_logger
from vllm_kvdisk.core.planner import Planner, trim_to_states, trim_to_windows
from vllm_kvdisk.core.policy import LoadCostModel
from vllm_kvdisk.core.report import REPORT_KEY, CacheReport
from vllm_kvdisk.core.saverules import Grid, SaveRules
from vllm_kvdisk.core.tokens import TokenTable
from vllm_kvdisk.core.writebudget import Admission, WriteBudget
from vllm_kvdisk.ops.diagnose import Diagnostics, LookupReport
from vllm_kvdisk.ops.metrics import KVDiskStats, snapshot
from vllm_kvdisk.ops.recorder import StatsRecorder
from vllm_kvdisk.ops.trace import Trace
from vllm_kvdisk.storage.fsdir import LockTimeout
from vllm_kvdisk.storage.objecttier import object_tier
from vllm_kvdisk.storage.store import Store

log = get_logger(__name__)

REFRESH_INTERVAL_S = 2.0
RESET_TRIES = 6  # reset_cache's thread waits for the lock this many times its timeout


class SchedulerSide:
    def __init__(
        self,
        config: KVDiskConfig,
        fingerprint: Fingerprint,
        table: TokenTable,
        block_size: int,
        context_size: int,
        *,
        events: bool = False,
        workers: int = 1,
        groups: tuple[Group, ...] = FULL_ONLY,
        kv_shards: int = 1,
    ):
        self.config = config
        self.kv_shards = kv_shards  # TP ranks with their own pages (namespaces)
        # KV cache groups (a hybrid model has several): a block id list each, in this order.
        self.groups = groups
        self.blocks = GroupBlocks(groups, block_size)
        self.windows = self.blocks.windows
        self.states = StateHandoffs(groups)  # Mamba / linear-attention states to save
        self.workers = workers  # every worker confirms each save job's copy once
        self.base_fp = fingerprint
        self.table = table
        self.block_size = block_size
        self.context_size = context_size
        grid = Grid(
            config.kv_cache_boundary_align_tokens, config.kv_cache_boundary_trim_tokens, block_size
        )
        self.rules = SaveRules(
            grid,
            config.kv_cache_min_tokens,
            config.kv_cache_cold_max_tokens,
            config.kv_cache_continued_interval_tokens,
            config.kv_cache_tail_checkpoints,
            cold_before_last_token=bool(self.windows) or self.states.active,
        )
        self.stats = StatsRecorder()
        self.trace = Trace.from_config(config)
        self.store = Store.from_config(
            config, on_drop=lambda e, why: self.trace.dropped(e.sha1, e.tokens, e.size, why)
        )
        started = time.monotonic()
        self.store.start()
        # The bucket behind the disk, if any: fetches here, uploads by the worker that saved.
        self.objects = object_tier(config, self.store)
        self.planner = Planner(
            self.store.index, block_size, self.store.read_ids, config.kv_cache_min_tokens
        )
        self.fetches = (
            None
            if self.objects is None
            else ObjectFetches(
                self.objects,
                self.store.index,
                table,
                block_size,
                config.kv_cache_min_tokens,
                self.trace,
            )
        )
        self.diagnostics = Diagnostics()
        self.report = LookupReport(
            self.store,
            table,
            self.stats,
            self.trace,
            self.diagnostics,
            config.kv_diagnose_excerpt_bytes,
        )
        self.cost = LoadCostModel()
        self.events = DiskEvents(events, block_size)
        self.saves = SavePlanning(
            planner=self.planner,
            rules=self.rules,
            table=table,
            blocks=self.blocks,
            events=self.events,
            store=self.store,
            context_size=context_size,
            workers=workers,
        )
        self.write_budget = WriteBudget(config.kv_disk_write_mb_per_day * 2**20, time.monotonic())
        self.admission = Admission(config.kv_disk_admission)
        self._reqs: dict[str, RequestState] = {}
        self._loads: list[LoadJob] = []
        self._holds: list[str] = []  # finished requests held for their copies, to tell workers
        self._held: set[str] = set()  # ... until their finished_sending arrives
        self.namespaces = Namespaces(fingerprint)
        self._last_refresh = 0.0
        self._stale: set[str] = set()  # namespaces to re-list at the next lookup
        self._quarantined_seen = 0
        # Pins (``kvdisk.pin_s``): seconds per request that asked, then per planned save
        # until it lands; written to ROOT/.pins off the step (``_pin``).
        self._pin_for: dict[str, int] = {}
        self._pending_pins: dict[Key, int] = {}
        self._pins_refused = False  # warned once
        self.pin_share_bytes = self.store.space_bytes * config.kv_disk_pin_share_pct // 100
        # Namespaces reset_cache removes but could not rename in the step (the lock was
        # busy): lookups in them miss until the thread renamed them (``_finish_resets``).
        self._resetting: set[str] = set()
        self._reset_mutex = threading.Lock()
        self.resetter: threading.Thread | None = None
        self._shutdown_requested = False
        self._shutdown_saved = False
        on_stop_signal(self._stop_requested)
        self.kv_cache_manager: Any = None
        log.info(
            "kvdisk: %d checkpoint(s), %.1f MiB of %d MiB budget in %s (scanned in %.2f s)",
            len(self.store.index),
            self.store.index.total_bytes / 2**20,
            config.kv_disk_space_mb,
            self.store.root,
            time.monotonic() - started,
        )

    def _stop_requested(self) -> None:
        self._shutdown_requested = True

    def block_size_restored(self) -> None:
        log.info(
            "kvdisk: vLLM's engine core reset its block size after start-up; put back to "
            "its KV cache groups' %d, so prefill chunks end on block boundaries",
            self.block_size,
        )

    # -- requests ---------------------------------------------------------------------
    def _ns(self, scope: Scope) -> str:
        return self.namespaces.name(scope.lora, scope.salt_digest)

    def _shard_namespaces(self, scope: Scope) -> list[str]:
        """The namespaces of the scope's other KV shards (TP ranks 1.. with pages of their
        own), each made as a save would make it; rank 0's is made too."""
        fp = self.namespaces.fingerprint(scope.lora, scope.salt_digest)
        self.store.ensure_namespace(fp)
        return [
            self.store.ensure_namespace(dataclasses.replace(fp, tp_rank=shard))
            for shard in range(1, self.kv_shards)
        ]

    def _state(self, request: Any) -> RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            lora = getattr(request, "lora_request", None)
            scope = Scope(
                lora=(getattr(lora, "lora_name", "") or "") if lora else "",
                salt_digest=salt_digest(
                    getattr(request, "cache_salt", None), key=self.store.salt_key
                ),
            )
            control = RequestControl.from_request(request)
            st = RequestState(request, scope, self._ns(scope), control)
            self._reqs[request.request_id] = st
            if control.pin_s and self.pin_share_bytes > 0:
                self._pin_for[request.request_id] = control.pin_s
            elif control.pin_s and not self._pins_refused:
                self._pins_refused = True
                log.warning("kvdisk: a request asked for a pin; pins are off (pin share 0)")
        return st

    def _refresh(self, ns: str) -> None:
        """Pick up files written since the last look: at most every 2 s, but at once while
        our own saves are in flight (a worker may have landed one whose report has not
        reached us yet) or a worker found the index stale; one stat of the directory when
        nothing changed."""
        now = time.monotonic()
        stale = ns in self._stale
        if (
            stale
            or self.store.index.has_pending()
            or now - self._last_refresh >= REFRESH_INTERVAL_S
        ):
            self._last_refresh = now
            self._stale.discard(ns)
            self.store.refresh(ns, force=stale)

    # -- lookups ----------------------------------------------------------------------
    @guarded("get_num_new_matched_tokens", lambda: (0, False))
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        if not st.may_load or request.prompt_token_ids is None:
            return 0, False
        usable = request.num_tokens - 1  # vLLM always computes at least one prompt token
        memo_key = (num_computed_tokens, usable)
        if not st.control.load:  # the request asked not to load: a miss, said as such
            st.memo, st.memo_key, st.memo_ids = Lookup(miss=Miss.SKIPPED), memo_key, None
            return 0, False
        if st.ns in self._resetting:  # being removed by reset_cache's thread: a miss
            st.memo_key = None
            return 0, False
        if self.fetches is not None and self.fetches.waiting(request.request_id):
            st.memo_key = None  # looked up again once the fetch ended
            return None, False  # vLLM asks again next step; other requests go on
        if st.memo_key != memo_key:
            self._refresh(st.ns)
            ids = as_token_array(request.prompt_token_ids[:usable])
            st.memo, st.memo_key, st.memo_ids = (
                self.planner.lookup(
                    st.ns, ids, usable, self.store.peers(st.scope.lora, st.scope.salt_digest)
                ),
                memo_key,
                ids,
            )
            if self.fetches is not None and self.fetches.start(
                request.request_id,
                st.ns,
                ids,
                usable,
                st.memo.tokens,
                lambda: self._shard_namespaces(st.scope),
            ):
                st.memo_key = None
                return None, False
            st.declined = None
            self._trim(st, num_computed_tokens)
            if self.config.kv_disk_load_policy == "auto" and st.memo.tokens > num_computed_tokens:
                self._apply_policy(st, num_computed_tokens)
                self._trim(st, num_computed_tokens)  # a cut may end inside a file used partly
        hit = st.memo.tokens if st.memo else 0
        if hit <= num_computed_tokens:
            return 0, False
        return hit - num_computed_tokens, True

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.33+, as a request enters the waiting queues: may it start a disk load
        while the running batch is full (``--max-num-inflight-kv-loads``)? Every kvdisk
        load is asynchronous, so: yes when the disk holds a hit beyond what the request has
        computed. The answer is ``get_num_new_matched_tokens``' own memoized lookup (its
        next call from the same point costs nothing). A hit the GPU prefix cache also
        holds is a false positive: vLLM then admits the request when a slot frees."""
        hit, _ = self.get_num_new_matched_tokens(request, request.num_computed_tokens)
        return bool(hit)

    def _trim(self, st: RequestState, num_computed: int) -> None:
        """A hybrid model's hit needs the window before it in every window group, and a
        stored state at its end in every state group."""
        if st.memo is None:
            return
        if self.windows:
            st.memo = trim_to_windows(st.memo, num_computed, self.windows, self.block_size)
        if self.states.active:
            st.memo = trim_to_states(st.memo, num_computed)

    def _apply_policy(self, st: RequestState, num_computed: int) -> None:
        """Cut the chain to the part that is cheaper to load than to recompute (a file is
        read whole even when only part of it is used)."""
        lookup = st.memo
        if lookup is None:
            return
        segments = lookup.segments
        below = sum(1 for s in segments if s.upto <= num_computed)
        costs = [
            (s.entry.size, s.upto - max(s.entry.parent_tokens, num_computed))
            for s in segments[below:]
        ]
        decision = self.cost.choose(costs)
        if decision.probe:
            self.trace.probe(segments[-1].entry.sha1, decision.load_s, decision.recompute_s)
        if decision.files < len(costs):
            st.memo = lookup.cut(below + decision.files, Miss.CHEAPER_TO_RECOMPUTE)
            st.declined = decision

    @guarded("update_state_after_alloc", lambda: None)
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.memo is None:
            return
        lookup, ids = st.memo, st.memo_ids
        on_device, usable = st.memo_key if st.memo_key else (0, request.num_tokens - 1)
        st.admitted(loading=num_external_tokens > 0)
        deepest = usable - usable % self.block_size  # as deep as a lookup may go
        st.report = report = CacheReport(
            request.num_prompt_tokens,
            on_device,
            max(0, num_external_tokens),
            lookup.segments[-1].entry.sha1 if num_external_tokens > 0 else None,
            None if lookup.tokens >= deepest else lookup.miss,
        )
        pin = self._pin_for.get(request.request_id)
        if pin and lookup.segments:  # the files the prompt continues: pinned now
            self._pin([(s.entry.key, pin) for s in lookup.segments])
        if pin:
            report.pin = {"seconds": pin}
        elif st.control.pin_s:
            report.pin = {"refused": "pins are off on this server (kv_disk_pin_share_pct 0)"}
        if num_external_tokens <= 0:
            self.stats.add("tokens_looked_up", request.num_prompt_tokens)
            self.report.no_load(
                st.ns, lookup, ids, on_device, st.declined, report, request.request_id
            )
            return
        hit = lookup.tokens
        if ids is None:  # the ids the lookup was made with (kept beside every hit)
            ids = as_token_array(request.prompt_token_ids[:hit])
        local = hit - num_external_tokens
        bs = self.block_size
        start, end = local // bs, hit // bs
        try:
            all_ids = blocks.get_block_ids()
            block_ids = self.blocks.main(all_ids)[start:end]
            segments = [s for s in lookup.segments if s.upto > local]
            files = [
                LoadFile(s.entry.sha1, s.entry.parent_tokens, s.upto, s.entry.tokens, s.entry.inode)
                for s in segments
            ]
            job = LoadJob(
                request.request_id,
                st.scope,
                files,
                start,
                block_ids,
                ids[:hit].astype("<u4").tobytes(),
                indexed_ns=st.ns,
            )
            if self.blocks.hybrid:
                self.blocks.place(job, segments, all_ids, local, hit)
        except Exception as exc:  # noqa: BLE001 - the request must still get its answer
            self.stats.count("errors", "update_state_after_alloc")
            log.exception("kvdisk: planning the load of %s failed", request.request_id)
            all_ids = blocks.get_block_ids()
            job = LoadJob(
                request.request_id,
                st.scope,
                [],
                start,
                self.blocks.main(all_ids)[start:end],
                fail=str(exc),
                groups=[list(g[start:end]) for g in all_ids] if len(all_ids) > 1 else [],
            )
        self._loads.append(job)
        self.stats.add("tokens_looked_up", request.num_prompt_tokens)
        source = (
            self.fetches.source(request.request_id, (f.sha1 for f in job.files))
            if self.fetches is not None
            else ""
        )
        self.report.hit(
            st.ns,
            lookup,
            ids,
            local,
            num_external_tokens,
            len(job.files),
            source,
            report,
            request.request_id,
        )

    # -- saves ------------------------------------------------------------------------
    def _block_ids(self, req_id: str) -> list[list[int]]:
        if self.kv_cache_manager is None:
            return []
        return [list(ids) for ids in self.kv_cache_manager.get_block_ids(req_id)]

    @guarded("build_connector_meta", lambda: StepMeta())
    def build_connector_meta(self, scheduler_output: Any) -> StepMeta:
        # Loads first: a request promised a load must get its job even if planning
        # saves fails below.
        meta = StepMeta(self._loads, [], scheduler_output.total_num_scheduled_tokens)
        self._loads = []
        try:
            self.states.preempted(scheduler_output.preempted_req_ids)
            offered = self.states.take(scheduler_output, self._state_saveable)
        except Exception:  # noqa: BLE001 - saves are optional; the loads above are not
            offered = []
            self._planning_failed()
        for req_id in offered:
            st = self._reqs.get(req_id)
            if st is not None and st.may_save:
                try:
                    at = self.states.junction(req_id, st.request)
                    if at:  # where conversations meet: saved before a later pin drops it
                        self._plan(st, [(at, Reason.COLD)])
                except Exception:  # noqa: BLE001 - one request's, never the others'
                    self._planning_failed()
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or not st.may_save:
                continue
            try:
                request = st.request
                before = request.num_computed_tokens
                due = self.rules.on_step(request.num_prompt_tokens, before, before + n_sched)
                # Under async scheduling the ids of the tokens in flight are not known yet
                # (computed counts them, all_token_ids does not): a position past the ids
                # waits for a later step, while its KV is still computed and the request's.
                due = sorted(set(due + [p for p in st.deferred if p[0] <= before]))
                known = len(request.all_token_ids)
                st.deferred = [p for p in due if p[0] > known]
                due = [p for p in due if p[0] <= known]
                if due:
                    self._plan(st, due)
            except Exception:  # noqa: BLE001 - one request's, never the others'
                self._planning_failed()
        if self._shutdown_requested and not self._shutdown_saved:
            self._shutdown_saved = True
            try:
                self._checkpoint_running()
            except Exception:  # noqa: BLE001
                self._planning_failed()
        meta.saves = self.saves.take()
        for job in meta.saves:
            pin = self._pin_for.get(job.req_id)
            if pin:
                self._pending_pins[(job.plan.ns, job.plan.sha1)] = pin
            st = self._reqs.get(job.req_id)  # a finished one's are noted by _finished
            if st is not None and st.report is not None:
                st.report.saves.append(job.plan.sha1)
        for req_id in [r for r in self._pin_for if r not in self._reqs]:
            del self._pin_for[req_id]  # finished: its last saves were just taken
        meta.holds, self._holds = self._holds, []
        meta.flush = [r for r in scheduler_output.preempted_req_ids or () if r in self._reqs]
        if self.fetches is not None:  # nothing to compute: let the fetches' threads run
            self.fetches.idle(scheduler_output.total_num_scheduled_tokens)
        return meta

    def _planning_failed(self) -> None:
        """A save plan raised: counted and logged; the request is answered all the same
        (saves are optional), and the other requests of the step still plan theirs."""
        self.stats.count("errors", "build_connector_meta")
        log.exception("kvdisk: planning saves failed")

    def _state_saveable(self, req_id: str, tokens: int) -> bool:
        """Whether a save of the request could ever be made at a state boundary of
        ``tokens`` (``_plan``'s conditions): only such a state is pinned."""
        st = self._reqs.get(req_id)
        if st is None or not st.may_save or not st.control.save:
            return False
        cap = st.control.max_save_tokens
        if cap is not None and tokens > self.rules.grid.block_floor(cap):
            return False
        return tokens >= self.rules.min_tokens

    def _checkpoint_running(self) -> None:
        """Shutdown saves: every running request's computed prefix, in case the drain
        that follows does not finish before the engine is killed."""
        for req_id, st in self._reqs.items():
            if not st.computing:
                continue
            request = st.request
            due = self.rules.on_shutdown(
                min(request.num_computed_tokens, len(request.all_token_ids))
            )
            if due:
                self._plan(st, due)

    def _plan(self, st: RequestState, due: list, group_ids: list[list[int]] | None = None) -> bool:
        """Plan a request's due saves. A state model saves only where a state is kept:
        at the newest boundary vLLM handed over, if a save is due at or after it."""
        if due and not self._may_write(st, len(due)):
            return False
        if group_ids is None:
            group_ids = self._block_ids(st.request.request_id)
        if not self.states.active:
            return self.saves.plan(st, due, group_ids)
        found = self.states.boundary(st.request.request_id)
        if found is None or not due:
            return False
        tokens, blocks = found
        later = [reason for length, reason in due if length >= tokens]
        if not later or tokens < self.rules.min_tokens:
            return False
        return self.saves.plan(st, [(tokens, later[0])], group_ids, states=blocks)

    def _may_write(self, st: RequestState, positions: int) -> bool:
        """The admission rule and the write budget; a refusal counts its positions."""
        request = st.request
        if self.admission.rule != "all":
            first = tuple((request.prompt_token_ids or ())[: self.block_size])  # no copy
            start = (st.ns, first)
            if len(first) < self.block_size or not self.admission.admits(start, request.request_id):
                self.stats.count("saves_skipped", "admission", positions)
                return False
        if not self.write_budget.allows(time.monotonic()):
            self.stats.count("saves_skipped", "write_budget", positions)
            return False
        return True

    @guarded("request_finished", lambda: (False, None))
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._finished(request, [list(block_ids)])

    @guarded("request_finished", lambda: (False, None))  # the same hook, per group
    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        return self._finished(request, [list(ids) for ids in block_ids])

    def _finished(self, request: Any, group_ids: list[list[int]]) -> tuple[bool, dict | None]:
        """Plan a finished request's saves and say whether vLLM must keep its blocks.
        Nothing below the planning can raise: whatever this answers, every job of the
        request still queued is covered by it (vLLM frees the blocks at once on False)."""
        req_id = request.request_id
        if self.fetches is not None:
            self.fetches.finished(req_id)
        st = self._reqs.pop(req_id, None)
        if st is None or not st.may_save:
            # A request aborted mid-load is released by its finished_recving, never here.
            self.states.finished(req_id, saving=False)
            return False, self._response_params(request, st)
        planned = False
        try:
            tables = min((len(ids) for ids in group_ids), default=0)
            computed = min(  # async scheduling: the ids of tokens in flight are unknown
                request.num_computed_tokens, tables * self.block_size, len(request.all_token_ids)
            )
            planned = self._plan(st, self.rules.on_finished(computed), group_ids)
            if st.report is not None:
                st.report.saves += [j.plan.sha1 for j in self.saves.jobs if j.req_id == req_id]
        except Exception:  # noqa: BLE001 - served without its saves, and without their jobs
            self.saves.drop(st)
            self.stats.count("errors", "request_finished")
            log.exception("kvdisk: planning the saves of finished %s failed", req_id)
        try:  # a state pin outlives the request only for a save copied later
            self.states.finished(req_id, saving=planned and st.holds_blocks)
        except Exception:  # noqa: BLE001 - a pin kept costs capacity, never correctness
            self.stats.count("errors", "request_finished")
            log.exception("kvdisk: releasing the state pin of %s failed", req_id)
        params = self._response_params(request, st)
        if not st.holds_blocks:
            return False, params
        # Some copy of its pages may still run (copies run after the step that planned
        # them): the blocks stay until the workers name the request in finished_sending.
        self._holds.append(request.request_id)
        self._held.add(request.request_id)
        return True, params

    def _response_params(self, request: Any, st: RequestState | None) -> dict[str, Any] | None:
        """What the response tells the client (``kv_transfer_params``): the request's
        :class:`CacheReport`, with the divergence only if the diagnostics thread has
        found it by now (never waited for). Never raises: a report is optional."""
        try:
            report = st.report if st is not None else None
            if report is None:  # no lookup was made (vLLM computed all, or loads were off)
                report = CacheReport(int(request.num_prompt_tokens))
                report.device_tokens = max(0, int(getattr(request, "num_cached_tokens", 0)))
            report.load_failed = st is not None and st.phase is Phase.FAILED
            return {REPORT_KEY: report.to_dict()}
        except Exception:  # noqa: BLE001
            self.stats.count("errors", "request_finished")
            log.exception("kvdisk: reporting on %s failed", request.request_id)
            return None

    # -- worker feedback --------------------------------------------------------------
    @guarded("update_connector_output", lambda: None)
    def update_connector_output(self, output: Any) -> None:
        self._held.difference_update(output.finished_sending or ())
        self.states.released(output.finished_sending)
        report = output.kv_connector_worker_meta
        for req_id in report.copied if isinstance(report, WorkerReport) else ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.copies_out -= 1
        # Failed loads come in our report, not vLLM's ``failed_recving``: that one makes
        # vLLM recompute the whole request, the invalid block ids only what was lost.
        # vLLM forwards each rank's report in the step it comes but a request's
        # finished_recving only once every rank sent it: a failure is recorded first and
        # applied by the finished_recving vLLM delivers (this step's or a later one).
        for req_id in report.failed_loads if isinstance(report, WorkerReport) else ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.load_failed()
        for req_id in output.finished_recving or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.load_finished()  # vLLM re-queues a failed one to recompute: no new load
        if not isinstance(report, WorkerReport):
            return
        index = self.store.index
        now = time.monotonic()
        landed_pins: list[tuple[Key, int]] = []
        for entry in report.written:
            self.write_budget.charge(entry.size, now)
            index.add(entry)
            self.events.landed(entry.key)
            pin = self._pending_pins.pop(entry.key, None)
            if pin:
                landed_pins.append((entry.key, pin))
        for ns, sha1 in report.failed_saves:
            index.release(ns, sha1)
            self.events.dropped((ns, sha1))
            self._pending_pins.pop((ns, sha1), None)
        if landed_pins:
            self._pin(landed_pins)
        # A report lists what was written and what was removed, not in which order: a
        # removal, or a file a load found stale, takes the file that went (its inode; a
        # stale one's 0 when the load's namespace was not the one indexed: by name),
        # never a file saved again under its name in the same step (written above).
        for ns, sha1, inode in [*report.removed, *report.stale]:
            known = index.get(ns, sha1)
            if known is not None and inode and known.inode != inode:
                continue  # saved again since: that file stays, and stays announced
            index.remove(ns, sha1)
            self.events.removed((ns, sha1))
        # A load found these gone or corrupt: maybe deleted by hand, which no journal line
        # says, so the namespace is listed at the next lookup. Evictions are journaled.
        self._stale.update(ns for ns, _, _ in report.stale)
        for nbytes, seconds in report.loads:
            self.cost.observe_load(nbytes, seconds)
        for tokens, seconds in report.steps:
            self.cost.observe_step(tokens, seconds)

    def _pin(self, pins: list[tuple[Key, int]]) -> None:
        """Pin checkpoints for their seconds from now, in ROOT/.pins, off the step (a
        write under the directory lock). A pin that cannot be written is logged: the
        files stay, only unprotected."""
        share = self.pin_share_bytes

        def write() -> None:
            now = time.time()
            try:
                self.store.pin([(key, now + seconds) for key, seconds in pins], share)
            except Exception as exc:  # noqa: BLE001 - a pin is a wish, never a failure
                log.warning("kvdisk: %d pin(s) not written: %s", len(pins), exc)

        if not self.diagnostics.submit(write):
            log.warning("kvdisk: %d pin(s) dropped: the background queue is full", len(pins))

    def take_events(self) -> list[Any]:
        return self.events.take()

    @guarded("reset_cache", lambda: False)
    def reset_cache(self) -> bool:
        """Remove this model's checkpoints (every LoRA, salt and TP rank of it) from disk.
        Each namespace directory is renamed away first, so concurrent readers only miss;
        its files are deleted by a thread, after the step. The rename is made under
        ``ROOT/.lock``, tried once here: where another process holds it, a thread waits
        for it and renames, and this engine's lookups in that namespace miss meanwhile."""
        mine = {
            k: v
            for k, v in self.base_fp.describe().items()
            if k not in ("lora", "salt_digest", "tp_rank", "pp_rank", "layers")
        }
        removed = spaces = 0
        for ns in self.store.namespaces():
            info = self.store.namespace_info(ns)
            if info is None or any(info.get(k) != v for k, v in mine.items()):
                continue
            try:  # in the engine's step: never a wait for the lock
                removed += self.store.remove_namespace(ns, wait=False, lock_timeout_s=0.0)
            except LockTimeout:
                with self._reset_mutex:
                    self._resetting.add(ns)
            spaces += 1
            self.events.removed_namespace(ns)
        with self._reset_mutex:
            if self._resetting and self.resetter is None:
                self.resetter = threading.Thread(
                    target=self._finish_resets, name="kvdisk-reset", daemon=True
                )
                self.resetter.start()
        for st in self._reqs.values():
            st.memo = st.memo_key = st.memo_ids = None
        log.info(
            "kvdisk: cache reset: %d checkpoint(s) removed in %d namespace(s) of %s%s",
            removed,
            spaces,
            self.base_fp.model,
            f" ({len(self._resetting)} left to a thread: the lock is busy)"
            if self._resetting
            else "",
        )
        return True

    def _finish_resets(self) -> None:
        """``reset_cache``'s thread: rename away each namespace it left, waiting for the
        lock (``kv_disk_lock_timeout_s`` a try, RESET_TRIES tries: a lock held longer is
        stuck, and the namespace is then served again, said in the log)."""
        tries: dict[str, int] = {}
        while True:
            with self._reset_mutex:
                todo = sorted(self._resetting)
                if not todo:
                    self.resetter = None
                    return
            for ns in todo:
                try:
                    removed = self.store.remove_namespace(ns, wait=False)
                    log.info("kvdisk: cache reset: %d checkpoint(s) removed in %s", removed, ns)
                except LockTimeout as exc:
                    tries[ns] = tries.get(ns, 0) + 1
                    if tries[ns] < RESET_TRIES:
                        continue
                    log.error("kvdisk: cache reset of %s given up: %s", ns, exc)
                except Exception:  # noqa: BLE001 - the thread must end, the namespace be served
                    log.exception("kvdisk: cache reset of %s failed", ns)
                with self._reset_mutex:
                    self._resetting.discard(ns)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping until saves in flight are reported (the index learns
        # of them, metrics are current, and a SIGTERM drain waits for them) and until held
        # blocks are given back.
        return self.store.index.has_pending() or bool(self._held or self._holds)

    def get_kv_connector_stats(self) -> KVDiskStats | None:
        index, store = self.store.index, self.store
        self.stats.set("disk_bytes", index.total_bytes)
        self.stats.set("disk_files", len(index))
        self.stats.set("disk_budget_bytes", store.space_bytes)
        self.stats.set("write_budget_left_bytes", self.write_budget.left(time.monotonic()))
        new_quarantines = store.stats.quarantined - self._quarantined_seen
        if new_quarantines:
            self.stats.add("quarantined", new_quarantines)
            self._quarantined_seen = store.stats.quarantined
        if self.objects is not None:
            self.objects.report_to(self.stats)
        return snapshot(self.stats)

    def shutdown(self) -> None:
        if self.objects is not None:
            self.objects.close()
        self.diagnostics.close()
        self.trace.close()
        self.store.close()
