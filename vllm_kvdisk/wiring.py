"""Build a connector half from vLLM's configuration (the one place that reads it).

The scheduler half needs the tokenizer (to render file names and texts), the worker half
the page layout; both need the same namespace fingerprint: model identity (weights, not
only the name: ``identity``), KV dtype, layout and page geometry, block size, TP shape.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vllm_kvdisk.config import KVDiskConfig, load_config
from vllm_kvdisk.identity import model_identity
from vllm_kvdisk.keys import Fingerprint, TokenTable

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_kvdisk.scheduler import SchedulerSide
    from vllm_kvdisk.worker import WorkerSide


def engine_config(vllm_config: VllmConfig) -> KVDiskConfig:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    return load_config(extra, os.environ)


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
    model_config = vllm_config.model_config
    model, revision = model_identity(str(model_config.model), model_config.revision)
    return Fingerprint(
        model=model, revision=revision, kv_dtype=dtype_name(spec.dtype),
        layout=f"{current_platform.device_type}:{layout}/"
               f"L{layers}xH{spec.num_kv_heads}xC{spec.head_size + head_v}",
        block_size=spec.block_size, tp_size=vllm_config.parallel_config.tensor_parallel_size,
        tp_rank=tp_rank)


def token_table_for(vllm_config: VllmConfig) -> TokenTable:
    from vllm.tokenizers import cached_tokenizer_from_config

    from vllm_kvdisk.tokens import table_from_tokenizer

    tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
    if tokenizer is None:
        raise ValueError("kvdisk needs the tokenizer (do not use --skip-tokenizer-init)")
    return table_from_tokenizer(tokenizer)


def build_scheduler_side(vllm_config: VllmConfig, kv_cache_config: Any) -> SchedulerSide:
    from vllm_kvdisk.scheduler import SchedulerSide

    fp = engine_fingerprint(vllm_config, kv_cache_config, tp_rank=0)
    events = getattr(vllm_config, "kv_events_config", None)
    return SchedulerSide(engine_config(vllm_config), fp, token_table_for(vllm_config),
                         fp.block_size, vllm_config.model_config.max_model_len,
                         events=bool(events and events.enable_kv_cache_events))


def build_worker_side(vllm_config: VllmConfig, kv_cache_config: Any) -> WorkerSide:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    from vllm_kvdisk.worker import WorkerSide

    fp = engine_fingerprint(vllm_config, kv_cache_config,
                            tp_rank=get_tensor_model_parallel_rank())
    return WorkerSide(engine_config(vllm_config), fp, fp.block_size)
