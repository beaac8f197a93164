"""Build a connector half from vLLM's configuration (the one place that reads it).

The scheduler half needs the tokenizer (to render file names and texts), the worker half
the page layout; both need the same namespace fingerprint: model identity (weights, not
only the name: ``identity``), KV dtype (vLLM's ``--kv-cache-dtype``), layout and page
geometry, block size, TP shape and KV shard, pipeline stage and its layers. What kvdisk
cannot serve exactly is refused here, at start-up (``compat``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

from vllm_kvdisk.core.compat import (
    GroupInfo,
    Placement,
    UnsupportedConfig,
    check_context_parallel,
    check_kv_dtype,
    check_sleep_mode,
    groups_signature,
    kv_dtype_identity,
    kv_groups,
    kv_shard,
    layer_range,
    state_signature,
    tp_replicas,
)
from vllm_kvdisk.core.config import KVDiskConfig, load_config
from vllm_kvdisk.core.format import GroupKind
from vllm_kvdisk.core.identity import model_identity
from vllm_kvdisk.core.keys import Fingerprint
from vllm_kvdisk.core.tokens import TokenTable, table_from_tokenizer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheConfig

    from vllm_kvdisk.connector.scheduler import SchedulerSide
    from vllm_kvdisk.connector.worker import WorkerSide


def engine_config(vllm_config: VllmConfig) -> KVDiskConfig:
    transfer = vllm_config.kv_transfer_config
    extra = dict(transfer.kv_connector_extra_config or {}) if transfer is not None else {}
    return load_config(extra, os.environ)


def engine_fingerprint(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, tp_rank: int, pp_rank: int = 0
) -> tuple[Fingerprint, Placement]:
    """Everything that makes this engine's pages (in)compatible with a file's pages, or
    UnsupportedConfig naming the setting that kvdisk cannot serve exactly."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from vllm_kvdisk.connector.transfer import dtype_name

    cache, parallel = vllm_config.cache_config, vllm_config.parallel_config
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise UnsupportedConfig("kvdisk: the engine has no KV cache groups")
    check_context_parallel(
        getattr(parallel, "decode_context_parallel_size", 1),
        getattr(parallel, "prefill_context_parallel_size", 1),
    )
    check_sleep_mode(bool(getattr(vllm_config.model_config, "enable_sleep_mode", False)))
    check_kv_dtype(str(cache.cache_dtype))  # before the tensor dtype: int8 has no name
    infos = [
        group_info(g.kv_cache_spec, len(g.layer_names)) for g in kv_cache_config.kv_cache_groups
    ]
    groups = kv_groups(infos)
    states = tuple(state_signature(i.state) for i in infos if i.state_mode)
    # Heads, head size and dtype come from the first attention group (kv_groups checked
    # that there is one); a state group's geometry is in the groups' signature.
    spec = cast(
        "AttentionSpec",  # the first group that is not a state is attention
        next(
            g.kv_cache_spec
            for g, kind in zip(kv_cache_config.kv_cache_groups, groups)
            if kind.kind != GroupKind.STATE
        ),
    )
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    # vLLM 0.34: a spec may group each KV head's K and V slots together (another page
    # order for the same shape); only then does the layout name say so.
    head_major = "/HKV" if getattr(spec, "kv_head_major_slots", False) else ""
    try:
        layout = str(cache.get_resolved_kv_cache_layout().name)
    except Exception:  # noqa: BLE001 - older/newer vLLM: the platform still tells it apart
        layout = "default"
    by_group = tuple(tuple(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    names = [name for layer_names in by_group for name in layer_names]
    model_config = vllm_config.model_config
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    # vLLM counts replicas only where backends publish their shard count; the model's
    # own shape (MLA, fewer KV heads than ranks) says it too. Both divide tp_size.
    replicas = max(
        getattr(kv_cache_config, "kv_tp_replicas", 1) or 1,
        tp_replicas(
            tp_size, model_config.get_total_num_kv_heads(), mla=isinstance(spec, MLAAttentionSpec)
        ),
    )
    if states:  # linear-attention states are sharded by head: every rank's are its own
        replicas = 1
    shard = kv_shard(tp_rank, tp_size, replicas)
    kv_dtype = kv_dtype_identity(
        str(cache.cache_dtype),
        dtype_name(spec.dtype),
        tuple(getattr(cache, "kv_cache_dtype_skip_layers", ()) or ()),
    )
    model, revision = model_identity(str(model_config.model), model_config.revision)
    fp = Fingerprint(
        model=model,
        revision=revision,
        kv_dtype=kv_dtype,
        layout=f"{current_platform.device_type}:{layout}/"
        f"L{len(names)}xH{spec.num_kv_heads}xC{spec.head_size + head_v}{head_major}"
        + groups_signature(groups, states),
        block_size=spec.block_size,
        tp_size=tp_size,
        tp_rank=shard.index,
        pp_size=pp_size,
        pp_rank=pp_rank if pp_size > 1 else 0,
        layers=layer_range(names) if pp_size > 1 else "",
    )
    return fp, Placement(
        tp_rank,
        pp_rank,
        shard,
        tuple(names),
        kv_cache_config.num_blocks,
        groups=groups,
        group_layers=by_group if len(by_group) > 1 else (),
    )


def restore_block_size(cache_config: Any, block_size: int) -> bool:
    """Put the engine core's ``cache_config.block_size`` back to its KV cache groups' block
    size where something reset it; True when it did.

    vLLM 0.32 sets it to the groups' block size once the cache is sized (640 for the tiny
    Qwen3-Next: the attention block raised until its page holds a state page;
    ``v1/engine/core.py:352``) and builds the scheduler with it. A multi-process engine core
    then re-runs ``VllmConfig.__post_init__`` after its start-up handshake
    (``EngineCoreProc._perform_handshakes``, ``v1/engine/core.py:1311``), and the CPU
    platform's ``check_and_update_config`` sets an unspecified block size to 128 again
    (``platforms/cpu.py:293``). The scheduler's Mamba split reads it at every step
    (``_mamba_block_aligned_split``, ``v1/core/sched/scheduler.py:469``): prefill chunks end
    on 128-token boundaries, so the states vLLM keeps (a chunk ending on a 640 boundary) are
    few, for kvdisk and for vLLM's own prefix cache alike. The offline engine (one process,
    no handshake) keeps 640. Nothing else in the scheduler reads the value at run time."""
    if block_size <= 0 or getattr(cache_config, "block_size", block_size) == block_size:
        return False
    cache_config.block_size = block_size
    return True


def group_info(spec: Any, layers: int) -> GroupInfo:
    """Plain values of one vLLM KV cache spec, for ``compat.kv_groups``."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    head_v = getattr(spec, "head_size_v", None) or getattr(spec, "head_size", 0)
    page = (
        str(getattr(spec, "dtype", "")),
        getattr(spec, "num_kv_heads", 0),
        getattr(spec, "head_size", 0),
        head_v,
        getattr(spec, "page_size_bytes", 0),
    )
    window = 0
    if isinstance(spec, SlidingWindowSpec):
        window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
    # Subclasses of FullAttentionSpec that change which blocks a hit needs (a window that
    # skips a middle gap, sinks, sparse sources) are not plain full attention.
    full = type(spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec")
    state_mode = ""
    state: tuple[tuple[tuple[int, ...], str], ...] = ()
    if type(spec).__name__ == "MambaSpec":
        state_mode = str(getattr(spec, "mamba_cache_mode", "") or "none")
        state = tuple(
            (tuple(int(d) for d in shape), str(dtype).removeprefix("torch."))
            for shape, dtype in zip(spec.shapes, spec.dtypes)
        )
    return GroupInfo(
        type(spec).__name__,
        layers,
        int(spec.block_size),
        page,
        full=full and isinstance(spec, FullAttentionSpec),
        window=window,
        state_mode=state_mode,
        state=state,
        speculative_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
        page_bytes=int(getattr(spec, "page_size_bytes", 0) or 0),
    )


def token_table_for(vllm_config: VllmConfig) -> TokenTable:
    from vllm.tokenizers import cached_tokenizer_from_config

    tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
    if tokenizer is None:
        raise ValueError("kvdisk needs the tokenizer (do not use --skip-tokenizer-init)")
    return table_from_tokenizer(tokenizer)


def build_scheduler_side(vllm_config: VllmConfig, kv_cache_config: Any) -> SchedulerSide:
    from vllm_kvdisk.connector.scheduler import SchedulerSide

    # vLLM builds the scheduler's KV cache config from the first worker's: the namespace
    # of TP rank 0 of pipeline stage 0.
    fp, placement = engine_fingerprint(vllm_config, kv_cache_config, tp_rank=0)
    events = getattr(vllm_config, "kv_events_config", None)
    return SchedulerSide(
        engine_config(vllm_config),
        fp,
        token_table_for(vllm_config),
        fp.block_size,
        vllm_config.model_config.max_model_len,
        groups=placement.groups,
        events=bool(events and events.enable_kv_cache_events),
        workers=vllm_config.parallel_config.world_size,
        # The other KV shards' namespaces (TP > 1) are fetched from a bucket beside rank
        # 0's; a pipeline stage's layer range is not known here, so stages are not.
        kv_shards=placement.shard.count if fp.pp_size == 1 else 1,
    )


def build_worker_side(vllm_config: VllmConfig, kv_cache_config: Any) -> WorkerSide:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    from vllm_kvdisk.connector.worker import WorkerSide

    fp, placement = engine_fingerprint(
        vllm_config,
        kv_cache_config,
        tp_rank=get_tensor_model_parallel_rank(),
        pp_rank=get_pp_group().rank_in_group,
    )
    return WorkerSide(engine_config(vllm_config), fp, fp.block_size, placement)
