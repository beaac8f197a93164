"""The vLLM-version-specific half of the contract tests: how a real vLLM ``Scheduler``
with kvdisk as its connector is built, and how model-runner outputs are synthesised (the
way vLLM's own connector unit tests do). Everything the tests ask of vLLM goes through
here, so the same tests run against another vLLM once this module knows its API.

vLLM 0.32 (the CPU build this project runs on): ``Scheduler`` / ``AsyncScheduler`` from
``vllm.v1.core.sched``; ``ModelRunnerOutput`` takes ``req_id_to_index``. vLLM 0.34 drops
that field; its ``Scheduler`` is built on a config that needs an explicit
``DeviceConfig("cpu")`` (the platform is not inferred without a vLLM build for it).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
import vllm
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_kvdisk.plugin import register

EOS = 2  # the tiny model's end-of-sequence id
VERSION = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2])
# vLLM 0.33+: requests a connector may load asynchronously start loading while the
# running batch is full (``--max-num-inflight-kv-loads``, ``may_load_async``).
# vLLM 0.33+ asks the connector class about sleep mode (``supports_sleep_mode``).
HAS_SLEEP_MODE_HOOK = hasattr(KVConnectorBase_V1, "supports_sleep_mode")
HAS_INFLIGHT_KV_LOADS = "max_num_inflight_kv_loads" in SchedulerConfig.__dataclass_fields__
_RUNNER_HAS_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
_hash_ready = False


def make_scheduler(
    model: str,
    kv_dir: str,
    *,
    block_size: int = 16,
    num_blocks: int = 400,
    tp: int = 1,
    async_scheduling: bool = False,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 16,
    max_num_inflight_kv_loads: int | None = None,
    enable_sleep_mode: bool = False,
    state_group: bool = False,
    **kvdisk: Any,
) -> Scheduler:
    """A real vLLM scheduler with kvdisk (config keys ``kvdisk``) as its connector, for a
    model of ``tp`` ranks (the tiny model: 4 layers, 2 KV heads of 64).
    ``max_num_inflight_kv_loads`` exists from vLLM 0.33 on; 0.32 ignores it here.
    ``state_group``: a hybrid model's KV cache instead, a Mamba state group in vLLM's
    align mode beside the attention group (vLLM's hybrid KV cache manager on)."""
    register()
    model_config = ModelConfig(model=model, dtype="float32", seed=0, max_model_len=8192)
    # Set after validation: ModelConfig refuses sleep mode on a platform without it (this
    # CPU machine), and what is tested is what vLLM and kvdisk say to it afterwards.
    model_config.enable_sleep_mode = enable_sleep_mode
    inflight = {}
    if HAS_INFLIGHT_KV_LOADS and max_num_inflight_kv_loads:
        inflight["max_num_inflight_kv_loads"] = max_num_inflight_kv_loads
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=8192,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        **inflight,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=True,
        **({"mamba_cache_mode": "align"} if state_group else {}),
    )
    transfer = KVTransferConfig(
        kv_connector="kvdisk",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kv_disk_dir": kv_dir, "kv_disk_min_free_mb": 0, **kvdisk},
    )
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    heads = max(1, 2 // tp)
    attention = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=64, dtype=torch.float32
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    groups = [KVCacheGroupSpec(layers, attention)]
    if state_group:
        # Layers 0-1 keep states, 2-3 attention; a state's page padded to the attention
        # page, as vLLM lays out a hybrid model in align mode.
        state = MambaSpec(
            block_size=block_size,
            shapes=((4, 64),),
            dtypes=(torch.float32,),
            page_size_padded=attention.page_size_bytes,
            mamba_cache_mode="align",
        )
        groups = [
            KVCacheGroupSpec([f"model.layers.{i}.linear_attn" for i in range(2)], state),
            KVCacheGroupSpec(layers[2:], attention),
        ]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    config.cache_config.num_gpu_blocks = num_blocks
    if state_group:  # this CPU platform reports no hybrid support: vLLM turned HMA off
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
    )


_ids = itertools.count(1)


def make_request(
    prompt: list[int],
    *,
    max_tokens: int = 8,
    block_size: int = 16,
    kv_transfer_params: dict | None = None,
    req_id: str | None = None,
) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    request = Request(
        request_id=req_id or f"r{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    request.kv_transfer_params = kv_transfer_params
    return request


def kv_output(
    *,
    sending: set[str] | None = None,
    recving: set[str] | None = None,
    invalid: set[int] | None = None,
    failed_recving: set[str] | None = None,
    meta: Any = None,
) -> KVConnectorOutput:
    return KVConnectorOutput(
        finished_sending=sending or None,
        finished_recving=recving or None,
        invalid_block_ids=set(invalid or ()),
        failed_recving=set(failed_recving or ()),
        kv_connector_worker_meta=meta,
    )


def runner_output(
    scheduler_output: Any, kv: KVConnectorOutput | None, token: int = 7
) -> ModelRunnerOutput:
    """One rank's output of a step: one sampled token per request the step computed."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return _runner_output(req_ids, sampled_token_ids=[[token] for _ in req_ids], kv=kv)


def empty_output() -> ModelRunnerOutput:
    return _runner_output([])


def _runner_output(req_ids: list[str], kv: KVConnectorOutput | None = None, **kw: Any):
    if _RUNNER_HAS_INDEX:  # vLLM 0.32; 0.34 dropped the field (rows follow req_ids)
        kw["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, kv_connector_output=kv, **kw)


def aggregator(tp: int) -> KVOutputAggregator:
    """vLLM's own aggregation of the ranks' outputs (what its executors run)."""
    return KVOutputAggregator(expected_finished_count=tp)


def copy_output(output: ModelRunnerOutput) -> ModelRunnerOutput:
    return dataclasses.replace(output)


def owned_blocks(scheduler: Scheduler, req_id: str, group: int | None = None) -> set[int]:
    """The engine blocks vLLM still holds for a request (none once it freed them), of one
    KV cache group or (None) of all."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    owned: set[int] = set()
    for manager in managers if group is None else [managers[group]]:
        owned.update(b.block_id for b in manager.req_to_blocks.get(req_id, ()) if not b.is_null)
    return owned


def preempted(scheduler: Scheduler) -> list[str]:
    """Requests vLLM preempted that wait to be scheduled again."""
    return [
        r.request_id for r in scheduler.requests.values() if r.status == RequestStatus.PREEMPTED
    ]


def block_table(scheduler: Scheduler, req_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(req_id)[0])


def block_tables(scheduler: Scheduler, req_id: str) -> list[list[int]]:
    """A request's block table in each KV cache group."""
    return [list(ids) for ids in scheduler.kv_cache_manager.get_block_ids(req_id)]


def is_loading(scheduler: Scheduler, req_id: str) -> bool:
    request = scheduler.requests.get(req_id)
    return request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def abort(scheduler: Scheduler, req_id: str) -> None:
    scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)


def kvdisk(scheduler: Scheduler) -> Any:
    """kvdisk's scheduler half inside vLLM's scheduler."""
    return scheduler.connector._sched


def all_blocks_free(scheduler: Scheduler) -> bool:
    """Every block back in vLLM's pool (the null block aside): nothing leaked or held."""
    pool = scheduler.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def free_blocks(scheduler: Scheduler) -> int:
    """Blocks in vLLM's free queue (cached ones included)."""
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def is_running(scheduler: Scheduler, req_id: str) -> bool:
    request = scheduler.requests.get(req_id)
    return request is not None and request.status == RequestStatus.RUNNING


def reset_prefix_cache(scheduler: Scheduler) -> bool:
    """Preempt every running request and empty the device prefix cache (kvdisk's disk
    cache is left alone: ``reset_connector`` False)."""
    return scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=False)
