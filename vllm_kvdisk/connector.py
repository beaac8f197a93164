"""``KVDiskConnector``: the vLLM V1 KV connector facade.

vLLM builds one instance per role: SCHEDULER (EngineCore process) and WORKER (each worker
process). The facade builds the matching half and delegates each method in one line; all
logic lives in :mod:`vllm_kvdisk.scheduler` and :mod:`vllm_kvdisk.worker`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_kvdisk.config import KVDiskConfig, load_config
from vllm_kvdisk.jobs import StepMeta
from vllm_kvdisk.keys import Fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


def engine_config(vllm_config: VllmConfig) -> KVDiskConfig:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    return load_config(extra)


def _model_identity(model_config: Any) -> tuple[str, str]:
    """Model name and a revision; for a local directory, a digest of its config.json."""
    model = str(model_config.model)
    revision = str(model_config.revision or "")
    config_json = os.path.join(model, "config.json")
    if not revision and os.path.isfile(config_json):
        with open(config_json, "rb") as fh:
            revision = "config-" + hashlib.sha256(fh.read()).hexdigest()[:16]
    return model, revision


def engine_fingerprint(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                       tp_rank: int) -> Fingerprint:
    """Everything that makes this engine's pages (in)compatible with a file's pages."""
    from vllm.platforms import current_platform

    from vllm_kvdisk.transfer import dtype_name

    cache = vllm_config.cache_config
    if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
        raise ValueError("kvdisk supports models with one KV cache group (full attention)")
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    try:
        layout = str(cache.get_resolved_kv_cache_layout().name)
    except Exception:  # noqa: BLE001 - older/newer vLLM: the platform still tells it apart
        layout = "default"
    layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
    model, revision = _model_identity(vllm_config.model_config)
    return Fingerprint(
        model=model, revision=revision, kv_dtype=dtype_name(spec.dtype),
        layout=f"{current_platform.device_type}:{layout}/"
               f"L{layers}xH{spec.num_kv_heads}xC{spec.head_size + head_v}",
        block_size=spec.block_size, tp_size=vllm_config.parallel_config.tensor_parallel_size,
        tp_rank=tp_rank)


def token_table_for(vllm_config: VllmConfig):
    from vllm.tokenizers import cached_tokenizer_from_config

    from vllm_kvdisk.tokens import table_from_tokenizer

    tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
    if tokenizer is None:
        raise ValueError("kvdisk needs the tokenizer (do not use --skip-tokenizer-init)")
    return table_from_tokenizer(tokenizer)


class KVDiskConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = engine_config(vllm_config)
        self._sched = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from vllm_kvdisk.scheduler import SchedulerSide

            fp = engine_fingerprint(vllm_config, kv_cache_config, tp_rank=0)
            self._sched = SchedulerSide(config, fp, token_table_for(vllm_config),
                                        fp.block_size, vllm_config.model_config.max_model_len)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from vllm_kvdisk.worker import WorkerSide

            fp = engine_fingerprint(vllm_config, kv_cache_config,
                                    tp_rank=get_tensor_model_parallel_rank())
            self._worker = WorkerSide(config, fp, fp.block_size)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: losing a save costs a future miss, never correctness

    # -- metrics ----------------------------------------------------------------------
    def get_kv_connector_stats(self) -> Any:
        return (self._sched or self._worker).stats_snapshot()

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> Any:
        from vllm_kvdisk.metrics import KVDiskStats

        return KVDiskStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from vllm_kvdisk.metrics import KVDiskPromMetrics

        return KVDiskPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker role ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_loads(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # pages are copied whole in wait_for_save (also works under CUDA graphs)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.step_started(connector_metadata)

    def wait_for_save(self) -> None:
        self._worker.step_computed()  # the forward is done: time it for the load policy
        self._worker.copy_out_and_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> Any:
        return self._worker.take_report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()

    # -- scheduler role ---------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.on_worker_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping until saves in flight are reported: the index learns
        # of them, metrics are current, and a SIGTERM drain waits for them.
        return self._sched.store.index.has_pending()


__all__ = ["KVDiskConnector", "StepMeta"]
