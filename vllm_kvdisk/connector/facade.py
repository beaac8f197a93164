"""``KVDiskConnector``: the vLLM V1 KV connector facade.

vLLM builds one instance per role: SCHEDULER (EngineCore process) and WORKER (each worker
process). The facade builds the matching half (``wiring``) and delegates each hook, in
one line, to the method of the same name on :mod:`vllm_kvdisk.connector.scheduler` or
:mod:`vllm_kvdisk.connector.worker`, so grepping a vLLM hook finds its implementation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_kvdisk.connector.jobs import StepMeta
from vllm_kvdisk.connector.wiring import (
    build_scheduler_side,
    build_worker_side,
    restore_block_size,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_kvdisk.connector.scheduler import SchedulerSide
    from vllm_kvdisk.connector.worker import WorkerSide


class KVDiskConnector(KVConnectorBase_V1, SupportsHMA):
    """SupportsHMA: vLLM keeps its hybrid KV cache manager on (one block table per KV
    cache group); every hook takes and returns block ids per group. What kvdisk cannot
    serve exactly (state groups, ...) is refused when the halves are built."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        # vLLM hands every connector its KV cache config (typed as required since 0.32).
        super().__init__(
            vllm_config=vllm_config,
            role=role,
            kv_cache_config=cast("KVCacheConfig", kv_cache_config),
        )
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._cache_config = vllm_config.cache_config
        if role == KVConnectorRole.SCHEDULER:
            self._sched = build_scheduler_side(vllm_config, kv_cache_config)
        else:
            self._worker = build_worker_side(vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: losing a save costs a future miss, never correctness

    # -- the half of this role ----------------------------------------------------------
    @property
    def sched(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("kvdisk: a scheduler hook was called on a worker's connector")
        return self._sched

    @property
    def worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("kvdisk: a worker hook was called on the scheduler's connector")
        return self._worker

    @property
    def half(self) -> SchedulerSide | WorkerSide:
        return self._sched if self._sched is not None else self.worker

    # -- what kvdisk declares to vLLM 0.33+ (0.32 asks none of these) ------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: sleep mode releases and remaps the KV cache, and kvdisk's worker holds views
        of the tensors it registered (it does not implement ``unregister_kv_caches`` /
        ``restore_kv_caches``). vLLM then refuses ``--enable-sleep-mode`` at start-up;
        ``compat.check_sleep_mode`` refuses it on vLLM 0.32, which does not ask."""
        return False

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """No: kvdisk keys checkpoints by token ids, never by vLLM's block hashes, and a
        checkpoint ends on a block boundary (vLLM then keeps its EAGLE trailing-block
        drop, the behaviour kvdisk was built against)."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """In-process torch copies only (no RDMA registration, no exported handles): any
        KV cache allocation works."""
        from vllm.config.kv_transfer import (  # type: ignore[attr-defined]  # vLLM >= 0.33
            KVCacheAccess,
        )

        return KVCacheAccess.IN_PROCESS

    # -- both roles -------------------------------------------------------------------
    def get_kv_connector_stats(self) -> Any:
        return self.half.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> Any:
        from vllm_kvdisk.ops.metrics import KVDiskStats

        return KVDiskStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        from vllm_kvdisk.ops.metrics import KVDiskPromMetrics

        return KVDiskPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self.half.shutdown()

    # -- worker role ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind_connector_metadata(cast(StepMeta, connector_metadata))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.handle_preemptions(cast(StepMeta, kv_connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(cast(StepMeta, self._get_connector_metadata()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # pages are copied whole after the step (also works under CUDA graphs)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(cast(StepMeta, self._get_connector_metadata()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self.worker.take_failed_recving(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self.worker.build_connector_worker_meta()

    # -- scheduler role ---------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.sched.kv_cache_manager = kv_cache_manager
        self.sched.states.pool = getattr(kv_cache_manager, "block_pool", None)
        null = getattr(getattr(kv_cache_manager, "block_pool", None), "null_block", None)
        if null is not None:
            self.sched.blocks.null_block = null.block_id

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # Asked for every waiting request before vLLM splits its prefill into chunks.
        self._keep_block_size()
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def _keep_block_size(self) -> None:
        """The block size vLLM's multi-process engine core resets after start-up
        (``wiring.restore_block_size``): a state model's prefill chunks end on its
        blocks again, so vLLM keeps (and kvdisk saves) the states at block boundaries.
        Only vLLM's Mamba split reads it at run time: other models are left alone."""
        sched = self.sched
        if sched.states.active and restore_block_size(self._cache_config, sched.block_size):
            sched.block_size_restored()

    def may_load_async(self, request: Any) -> bool:
        return self.sched.may_load_async(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.sched.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.sched.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        return self.sched.request_finished_all_groups(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.sched.has_pending_push_work()

    def take_events(self) -> Iterable[Any]:
        return self.sched.take_events()

    def reset_cache(self) -> bool | None:
        return self.sched.reset_cache()


__all__ = ["KVDiskConnector", "StepMeta"]
