"""Scheduler half of the connector: lookups, load plans and save plans.

Runs in vLLM's EngineCore process. It owns a read-mostly view of the cache directory (the
index) and never writes checkpoint files itself: it decides, the worker copies and writes,
and the worker's per-step :class:`WorkerReport` tells the index what landed.

Invariants:
* ``get_num_new_matched_tokens`` has no side effect beyond a memo of its own answer.
* A hit is always block-aligned, beyond what the GPU prefix cache holds, below the full
  prompt, and asynchronous.
* A request whose load failed is never offered the disk cache again (no retry loop).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_kvdisk.config import KVDiskConfig
from vllm_kvdisk.format import (MAX_KTM_ENTRIES, MAX_TOOL_ID_BYTES, MAX_TOOL_TEXT_BYTES, Reason,
                                read_tokens)
from vllm_kvdisk.index import Lookup, Miss
from vllm_kvdisk.jobs import LoadFile, LoadJob, SaveJob, Scope, StepMeta, WorkerReport
from vllm_kvdisk.metrics import KVDiskStats, StatsRecorder
from vllm_kvdisk.keys import Fingerprint, Grid, KeyCache, TokenTable, salt_digest
from vllm_kvdisk.planner import Planner, Prompt
from vllm_kvdisk.policy import Decision, LoadCostModel
from vllm_kvdisk.store import Store
from vllm_kvdisk.trace import Trace

log = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 2.0


@dataclass(slots=True)
class _Req:
    request: Any
    scope: Scope
    ns: str
    memo_key: tuple[int, int] | None = None
    memo: Lookup | None = None
    memo_prompt: Prompt | None = None
    declined: Decision | None = None  # the load policy found recomputing cheaper
    loading: bool = False
    load_failed: bool = False


def tool_entries(request: Any, text: bytes) -> list[tuple[str, str]]:
    """The (tool-call id, exact text) pairs the request carries whose text the checkpoint
    contains: they go into the file's KTM section so replay survives restarts."""
    params = getattr(request, "kv_transfer_params", None) or {}
    pairs = params.get("kvdisk_tool_map") if isinstance(params, dict) else None
    if not isinstance(pairs, list):
        return []
    out = []
    for pair in pairs[:MAX_KTM_ENTRIES]:
        if (isinstance(pair, (list, tuple)) and len(pair) == 2
                and all(isinstance(x, str) for x in pair)
                and 0 < len(pair[0].encode()) <= MAX_TOOL_ID_BYTES
                and len(pair[1].encode()) <= MAX_TOOL_TEXT_BYTES
                and pair[1] and pair[1].encode() in text):
            out.append((pair[0], pair[1]))
    return out


class SchedulerSide:
    def __init__(self, config: KVDiskConfig, fingerprint: Fingerprint, table: TokenTable,
                 block_size: int, context_size: int):
        self.config = config
        self.base_fp = fingerprint
        self.table = table
        self.block_size = block_size
        self.context_size = context_size
        self.grid = Grid(config.kv_cache_boundary_align_tokens,
                         config.kv_cache_boundary_trim_tokens, block_size)
        self.store = Store(config.kv_disk_dir, space_bytes=config.space_bytes,
                           min_free_bytes=config.min_free_bytes)
        self.store.scan()
        self.planner = Planner(self.store.index, self.grid, config.kv_cache_min_tokens)
        self.trace = Trace(config.trace)
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self._saves: list[SaveJob] = []
        self._ns_cache: dict[tuple[str, str], str] = {}
        self._last_refresh = 0.0
        self.key_cache = KeyCache()
        self.cost = LoadCostModel()
        self.stats = StatsRecorder()
        self._quarantined_seen = 0
        self._shutdown_requested = False
        self._shutdown_saved = False
        self._watch_shutdown()
        self.kv_cache_manager: Any = None
        log.info("kvdisk: %d checkpoint(s), %d bytes in %s", len(self.store.index),
                 self.store.index.total_bytes, self.store.root)

    def _watch_shutdown(self) -> None:
        """Learn when vLLM's engine process is told to stop, to checkpoint running requests.

        vLLM installs its SIGTERM/SIGINT handlers in the engine process before it builds the
        scheduler; we chain ours in front of them. An in-process engine (default handlers)
        is left alone: its owner's signals are not ours to take.
        """
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous = signal.getsignal(sig)
                if not callable(previous) or previous is signal.default_int_handler:
                    continue

                def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                    self._shutdown_requested = True
                    previous(signum, frame)

                signal.signal(sig, handler)
            except ValueError:  # not the main thread
                return

    # -- namespaces -------------------------------------------------------------------
    def _scope(self, request: Any) -> Scope:
        lora = getattr(request, "lora_request", None)
        return Scope(lora=(getattr(lora, "lora_name", "") or "") if lora else "",
                     salt_digest=salt_digest(getattr(request, "cache_salt", None)))

    def _ns(self, scope: Scope) -> str:
        key = (scope.lora, scope.salt_digest)
        if key not in self._ns_cache:
            fp = Fingerprint(**{**self.base_fp.describe(), "lora": scope.lora,
                                "salt_digest": scope.salt_digest})
            self._ns_cache[key] = fp.dirname()
        return self._ns_cache[key]

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            scope = self._scope(request)
            st = _Req(request, scope, self._ns(scope))
            self._reqs[request.request_id] = st
        return st

    def _refresh(self, ns: str) -> None:
        """Pick up files written since the last look: at most every 2 s, but at once while
        our own saves are in flight (a worker may have landed one whose report has not
        reached us yet; the check is one stat of the directory when nothing changed)."""
        now = time.monotonic()
        if self.store.index.has_pending() or now - self._last_refresh >= REFRESH_INTERVAL_S:
            self._last_refresh = now
            self.store.refresh(ns)

    # -- lookups ----------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        st = self._state(request)
        if st.load_failed or request.prompt_token_ids is None:
            return 0, False
        usable = request.num_tokens - 1  # vLLM always computes at least one prompt token
        memo_key = (num_computed, usable)
        if st.memo_key != memo_key:
            self._refresh(st.ns)
            prompt = Prompt(self.table, self.grid, request.prompt_token_ids, limit=usable,
                            cache=self.key_cache)
            st.memo, st.memo_key = self.planner.lookup(st.ns, prompt, usable), memo_key
            st.memo_prompt = prompt
            st.declined = None
            if self.config.kv_disk_load_policy == "auto" and st.memo.tokens > num_computed:
                self._apply_policy(st, num_computed)
        hit = st.memo.tokens if st.memo else 0
        if hit <= num_computed:
            return 0, False
        return hit - num_computed, True

    def _apply_policy(self, st: _Req, num_computed: int) -> None:
        """Cut the chain to the part that is cheaper to load than to recompute."""
        lookup = st.memo
        beyond = [e for e in lookup.chain if e.tokens > num_computed]
        costs = [(e.size, e.tokens - max(e.parent_tokens, num_computed)) for e in beyond]
        decision = self.cost.choose(costs)
        if decision.probe:
            self.trace.line(f"probe for sha1={lookup.chain[-1].sha1} (loading although "
                            f"recompute looked cheaper: est. load {decision.load_s * 1e3:.0f} ms "
                            f"vs recompute {decision.recompute_s * 1e3:.0f} ms; re-measuring "
                            f"the store)")
        if decision.files == len(beyond):
            return
        keep = len(lookup.chain) - len(beyond) + decision.files
        st.memo = Lookup(lookup.chain[:keep], Miss.CHEAPER_TO_RECOMPUTE,
                         lookup.miss_key, lookup.other_namespaces)
        st.declined = decision

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.memo is None:
            return
        lookup, prompt = st.memo, st.memo_prompt
        on_device = st.memo_key[0] if st.memo_key else 0
        st.memo = st.memo_key = st.memo_prompt = None
        self.stats.add("tokens_looked_up", request.num_prompt_tokens)
        if num_external <= 0:
            if lookup.chain and lookup.tokens <= on_device:
                self.stats.count("lookups", "device_hit:")
                self.trace.line(f"device hit for sha1={lookup.chain[-1].sha1} ({on_device} "
                                f"tokens in the GPU prefix cache cover the {lookup.tokens} on disk)")
            else:
                self._miss(st, lookup, prompt)
            return
        self.stats.count("lookups", "hit:")
        hit = lookup.tokens
        local = hit - num_external
        bs = self.block_size
        start, end = local // bs, hit // bs
        block_ids = list(blocks.get_block_ids()[0][start:end])
        files = [LoadFile(e.sha1, e.tokens, e.parent_tokens) for e in lookup.chain
                 if e.tokens > local]
        self._loads.append(LoadJob(request.request_id, st.scope, files, start, block_ids))
        st.loading = True
        if self.trace.enabled:
            deeper = ""
            if lookup.miss is not None:
                miss = self._why_not_deeper(st, lookup)
                deeper = f"; not deeper: {self._detail(st, lookup, miss, prompt)}"
            self.trace.line(f"hit for sha1={lookup.chain[-1].sha1} (restoring {num_external} tokens "
                            f"from {len(files)} file(s); {local} already in the GPU cache{deeper})")

    def _why_not_deeper(self, st: _Req, lookup: Lookup) -> Miss:
        miss = lookup.miss or Miss.NO_CHECKPOINT
        if (miss is Miss.NO_CHECKPOINT and lookup.chain
                and self.store.index.children(st.ns, lookup.chain[-1].sha1)):
            return Miss.PREFIX_MISMATCH  # a deeper checkpoint of this prefix exists
        return miss

    def _detail(self, st: _Req, lookup: Lookup, miss: Miss, prompt: Prompt | None) -> str:
        """Human words for the trace; reads a file or two, so only when tracing."""
        key = lookup.miss_key
        try:
            if miss is Miss.PREFIX_MISMATCH and prompt is not None:
                return self._divergence(st.ns, lookup, prompt) or miss.value
            if miss is Miss.OTHER_NAMESPACE:
                return f"{miss.value} ({', '.join(lookup.other_namespaces)})"
            if miss is Miss.CHEAPER_TO_RECOMPUTE and st.declined is not None:
                d = st.declined
                return (f"{miss.value}: load {d.load_s * 1e3:.0f} ms vs prefill "
                        f"{d.recompute_s * 1e3:.0f} ms")
            if miss is Miss.TOKENS_DIFFER and key is not None and prompt is not None:
                with self.store.open(st.ns, key.sha1) as (fd, meta, _):
                    theirs = np.frombuffer(read_tokens(fd, meta), dtype="<u4")
                mine = prompt.ids[: len(theirs)]
                at = int(np.argmax(mine != theirs)) if len(mine) == len(theirs) else len(mine)
                return f"{miss.value} at token {at}"
        except Exception as exc:  # noqa: BLE001 - diagnostics must never fail a request
            return f"{miss.value} ({exc})"
        return miss.value

    def _miss(self, st: _Req, lookup: Lookup, prompt: Prompt | None) -> None:
        miss = self._why_not_deeper(st, lookup)
        self.stats.count("lookups", f"miss:{miss.label}")
        if not self.trace.enabled:
            return
        sha = lookup.miss_key.sha1 if lookup.miss_key else "-"
        detail = self._detail(st, lookup, miss, prompt)
        if lookup.chain:
            detail += f"; deepest checkpoint {lookup.tokens} tokens"
        self.trace.line(f"miss for sha1={sha} (reason: {detail})")

    def _divergence(self, ns: str, lookup: Lookup, prompt: Prompt) -> str | None:
        """Where the prompt leaves the closest deeper checkpoint (a child of the hit)."""
        base = lookup.chain[-1].sha1 if lookup.chain else None
        kids = self.store.index.children(ns, base) if base else []
        best = None
        for kid in kids[:8]:
            text = self.store.read_text(ns, kid.sha1)
            common = os.path.commonprefix([text, prompt.text[: len(text)]])
            if best is None or len(common) > best[0]:
                best = (len(common), kid.sha1)
        if best is None:
            return None
        return f"prefix mismatch at byte {best[0]} of checkpoint {best[1]}"

    # -- saves ------------------------------------------------------------------------
    def _plan_save(self, st: _Req, length: int, reason: Reason, block_ids: list[int],
                   release: bool = False) -> bool:
        request = st.request
        ids = list(request.all_token_ids[:length])
        if length <= 0 or len(ids) < length:
            return False
        prompt = Prompt(self.table, self.grid, ids, cache=self.key_cache)
        plan = self.planner.plan_save(st.ns, prompt, length, reason)
        if plan is None:
            return False
        bs = self.block_size
        owned = block_ids[plan.parent_tokens // bs: length // bs]
        if len(owned) != (length - plan.parent_tokens) // bs:
            return False
        self.planner.reserve(plan, prompt.digest(length), int(time.time()))
        text = prompt.text_upto(length)
        self._saves.append(SaveJob(
            request.request_id, st.scope, plan.sha1, length, plan.parent, plan.parent_tokens,
            reason, list(owned), text, prompt.ids[:length].astype("<u4").tobytes(),
            self.context_size, tool_map=tool_entries(request, text), release_blocks=release))
        return True

    def _block_ids(self, req_id: str) -> list[int]:
        if self.kv_cache_manager is None:
            return []
        return list(self.kv_cache_manager.get_block_ids(req_id)[0])

    def build_meta(self, scheduler_output: Any) -> StepMeta:
        cfg = self.config
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or st.load_failed:
                continue
            request = st.request
            before = request.num_computed_tokens
            after = before + n_sched
            n_prompt = request.num_prompt_tokens
            if before < n_prompt <= after:
                length = self.grid.floor(n_prompt)
                if cfg.kv_cache_min_tokens <= length <= cfg.kv_cache_cold_max_tokens:
                    self._plan_save(st, length, Reason.COLD, self._block_ids(req_id))
            interval = cfg.kv_cache_continued_interval_tokens
            if after // interval > before // interval:
                self._plan_save(st, self.grid.floor(after), Reason.CONTINUED,
                                self._block_ids(req_id))
        if self._shutdown_requested and not self._shutdown_saved:
            self._shutdown_saved = True
            self._checkpoint_running()
        meta = StepMeta(self._loads, self._saves, scheduler_output.total_num_scheduled_tokens)
        self._loads, self._saves = [], []
        return meta

    def _checkpoint_running(self) -> None:
        """Shutdown saves: every running request's computed prefix, in case the drain
        that follows does not finish before the engine is killed."""
        for req_id, st in self._reqs.items():
            if st.loading or st.load_failed:
                continue
            length = self.grid.floor(st.request.num_computed_tokens)
            if length >= self.config.kv_cache_min_tokens:
                self._plan_save(st, length, Reason.SHUTDOWN, self._block_ids(req_id))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None or st.loading or st.load_failed:
            # A request aborted mid-load is released by its finished_recving, never here.
            return False, None
        computed = min(request.num_computed_tokens, len(block_ids) * self.block_size)
        length = self.grid.floor(computed)
        if length < self.config.kv_cache_min_tokens:
            return False, None
        return self._plan_save(st, length, Reason.EVICT, list(block_ids), release=True), None

    # -- worker feedback --------------------------------------------------------------
    def on_worker_output(self, output: Any) -> None:
        for req_id in output.finished_recving or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.loading = False
        for req_id in getattr(output, "failed_recving", None) or ():
            st = self._reqs.get(req_id)
            if st is not None:
                st.load_failed = True
        report = output.kv_connector_worker_meta
        if not isinstance(report, WorkerReport):
            return
        index = self.store.index
        for entry in report.written:
            index.add(entry)
        for ns, sha1 in report.failed_saves:
            index.release(ns, sha1)
        for ns, sha1 in report.removed:
            index.remove(ns, sha1)
        for nbytes, seconds in report.loads:
            self.cost.observe_load(nbytes, seconds)
        for tokens, seconds in report.steps:
            self.cost.observe_step(tokens, seconds)

    def stats_snapshot(self) -> KVDiskStats | None:
        index, store = self.store.index, self.store
        self.stats.set("disk_bytes", index.total_bytes)
        self.stats.set("disk_files", len(index))
        self.stats.set("disk_budget_bytes", store.space_bytes)
        new_quarantines = store.stats.quarantined - self._quarantined_seen
        if new_quarantines:
            self.stats.add("quarantined", new_quarantines)
            self._quarantined_seen = store.stats.quarantined
        return self.stats.snapshot()

    def shutdown(self) -> None:
        self.trace.close()
