"""Engine configurations a GPU user runs, checked here with vLLM's own objects: each one is
served exactly (byte-identical pages, untouched neighbours) or refused at start-up with a
message naming the setting. No engine runs: kernel-block splits come from vLLM's own
``allocate_kv_cache``, configurations from its own config classes.
"""

from __future__ import annotations

import typing

import numpy as np
import pytest
import torch
from workers import make_worker, save_job

from vllm_kvdisk.connector.jobs import LoadFile, LoadJob, Scope, StepMeta
from vllm_kvdisk.connector.worker import WorkerSide
from vllm_kvdisk.core.compat import (
    Placement,
    Shard,
    UnsupportedConfig,
    kv_dtype_identity,
    kv_shard,
    tp_replicas,
)
from vllm_kvdisk.core.keys import Fingerprint, rank_group

NUM_BLOCKS = 12
LAYERS = 3
IDS = np.arange(5_000, 5_000 + NUM_BLOCKS * 256, dtype="<u4")


def worker(
    tmp_path, block: int, placement: Placement, fp: Fingerprint | None = None, name: str = "kv"
) -> WorkerSide:
    return make_worker(
        tmp_path,
        None,
        block=block,
        fp=fp,
        placement=placement,
        name=name,
        kv_disk_io_threads=2,
        kv_disk_lock_timeout_s=3,
    )


def save(w: WorkerSide, blocks: list[int]) -> str:
    job = save_job(IDS, blocks, block=w.block_size, ns=w.base_fp.dirname())
    w.wait_for_save(StepMeta(saves=[job]))
    w.drain()
    return job.plan.sha1


def load(w: WorkerSide, sha1: str, tokens: int, targets: list[int]) -> list[int]:
    return w.loads.load(
        LoadJob(
            "r", Scope(), [LoadFile(sha1, 0, tokens, tokens)], 0, targets, IDS[:tokens].tobytes()
        )
    )


# -- 1. kernel blocks smaller than vLLM's block --------------------------------------------
def split_views(layout_name: str, block: int, kernel: int):
    """What a backend with ``kernel``-token kernel blocks hands the connector, built by vLLM."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=4, dtype=torch.float32)
    per_block = LAYERS * spec.page_size_bytes
    fixed = (None, per_block if layout.is_block_outermost else None, None, None, None)
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, NUM_BLOCKS, LAYERS, layout, fixed_strides=fixed
    )
    names = [f"model.layers.{i}.attn" for i in range(LAYERS)]
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=per_block * NUM_BLOCKS,
                layers=names,
                layer_stride=layer_stride,
                block_stride=block_stride,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    return allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes=[kernel])


SPLITS = [(b, k) for b in (64, 128, 256) for k in (16, 32, 64) if k < b]
LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]
SPLITTABLE = {"LBHNC", "LBNHC"}  # blocks stored as dense pages: vLLM splits only these


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_splits_blocks_into_kernel_blocks_only_in_dense_page_layouts(layout):
    """The layouts the tests below cover are every layout vLLM accepts for a split."""
    if layout in SPLITTABLE:
        views = split_views(layout, 128, 32)
        assert next(iter(views.values())).shape[0] == NUM_BLOCKS * 4
    else:
        with pytest.raises(ValueError, match="cannot be split"):
            split_views(layout, 128, 32)


@pytest.mark.parametrize("host", [True, False], ids=["host-path", "device-path"])
@pytest.mark.parametrize("layout", sorted(SPLITTABLE))
@pytest.mark.parametrize("block,kernel", SPLITS)
def test_kernel_block_views_round_trip_whole_blocks(tmp_path, block, kernel, layout, host):
    """Block b is kernel blocks b*r .. b*r+r-1: a save of blocks A restores byte-identical
    into blocks B, and every other block, in every layer, keeps its bytes."""
    from vllm.v1.kv_cache_interface import group_kernel_blocks

    views = split_views(layout, block, kernel)
    for v in views.values():
        v.copy_(torch.randn(v.shape))
    grouped = [group_kernel_blocks(v, NUM_BLOCKS) for v in views.values()]
    w = worker(tmp_path, block, Placement(num_blocks=NUM_BLOCKS, layer_names=tuple(views)))
    w.register_kv_caches(views)
    try:
        if not host:
            w.mover._host = None  # the torch page path a GPU cache takes
        assert w.mover.num_blocks == NUM_BLOCKS
        assert w.mover.page_bytes * NUM_BLOCKS * LAYERS == sum(
            v.numel() * 4 for v in views.values()
        )
        out = [np.empty(2 * w.mover.page_bytes, dtype=np.uint8) for _ in grouped]
        w.mover.gather([5, 2], out)
        for g, got in zip(grouped, out):  # vLLM's own grouping is the reference
            assert got.tobytes() == g[[5, 2]].contiguous().numpy().tobytes()
        src, dst = [1, 2, 3, 7], [11, 5, 9, 0]
        want = [g[src].clone() for g in grouped]
        before = [g.clone() for g in grouped]
        sha1 = save(w, src)
        assert load(w, sha1, len(src) * block, dst) == []
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        for g, page, old in zip(grouped, want, before):
            assert torch.equal(g[dst], page)
            assert torch.equal(g[others], old[others])  # no half-block of a neighbour moved
    finally:
        w.shutdown()


@pytest.mark.parametrize("rows", [NUM_BLOCKS - 1, 2 * NUM_BLOCKS + 1])
def test_a_view_whose_block_count_does_not_match_the_config_is_refused(tmp_path, rows):
    w = worker(tmp_path, 64, Placement(num_blocks=NUM_BLOCKS))
    try:
        with pytest.raises(ValueError, match="not a whole number of kernel blocks"):
            w.register_kv_caches({"l0": torch.zeros(rows, 2, 32, 8)})
        assert w.mover is None
    finally:
        w.shutdown()


# -- 2. pipeline parallel, 3. KV dtype, 4. context parallel: vLLM's config objects ---------
@pytest.fixture(scope="module")
def vllm_config_of(tmp_path_factory):
    """A VllmConfig of the tiny model with some settings changed (no engine started)."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    from vllm_kvdisk.testing.tinymodel import build_tiny_model

    model = str(build_tiny_model(tmp_path_factory.mktemp("cfg") / "tiny", seed=0))
    model_config = ModelConfig(model=model, dtype="float32")

    def make(cache_dtype: str = "auto", **parallel) -> VllmConfig:
        return VllmConfig(
            model_config=model_config,
            parallel_config=ParallelConfig(**parallel),
            cache_config=CacheConfig(block_size=128, cache_dtype=cache_dtype),
        )

    return make


def kv_cache_config(layers: range, dtype=torch.float32, mla: bool = False, tp_size: int = 1):
    """A worker's KV cache config, with the replica count vLLM computes for it."""
    from vllm.v1.core.kv_cache_utils import kv_cache_groups_tp_replicas
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )

    names = [f"model.layers.{i}.self_attn.attn" for i in layers]
    if mla:
        spec = MLAAttentionSpec(
            block_size=128, num_kv_heads=1, head_size=72, dtype=dtype, max_tp_shards=1
        )  # as vLLM's MLA layer publishes it
    else:
        spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=dtype)
    groups = [KVCacheGroupSpec(names, spec)]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    config.kv_tp_replicas = kv_cache_groups_tp_replicas(groups, tp_size)
    return config


def test_pipeline_stages_have_their_own_namespaces(vllm_config_of):
    """Two stages of two layers each used to share one namespace (same shapes, rank 0):
    their files replaced each other and each restored the other stage's layers."""
    from vllm_kvdisk.connector.wiring import engine_fingerprint

    cfg = vllm_config_of(pipeline_parallel_size=2)
    stage0, place0 = engine_fingerprint(cfg, kv_cache_config(range(0, 2)), tp_rank=0, pp_rank=0)
    stage1, place1 = engine_fingerprint(cfg, kv_cache_config(range(2, 4)), tp_rank=0, pp_rank=1)
    assert stage0.dirname() != stage1.dirname()
    assert (stage0.pp_rank, stage1.pp_rank, stage0.pp_size) == (0, 1, 2)
    assert stage1.layers == "model.layers.2.self_attn.attn..model.layers.3.self_attn.attn"
    # The scheduler's KV cache config is a copy of the first worker's: stage 0's namespace.
    sched, _ = engine_fingerprint(cfg, kv_cache_config(range(0, 2)), tp_rank=0)
    assert sched.dirname() == stage0.dirname()
    # One engine: the stages' namespaces evict together, like TP ranks.
    assert rank_group(stage0.describe()) == rank_group(stage1.describe()) is not None
    # A single-stage engine keeps the namespace it had before stages were recorded.
    single, _ = engine_fingerprint(vllm_config_of(), kv_cache_config(range(0, 4)), tp_rank=0)
    assert "pp_rank" not in single.describe() and single.layers == ""
    assert place1.layer_names == ("model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn")


def test_a_worker_handed_another_stages_layers_refuses_to_register(tmp_path):
    place = Placement(layer_names=("model.layers.2.attn", "model.layers.3.attn"))
    w = worker(tmp_path, 16, place)
    try:
        with pytest.raises(ValueError, match="lack 2 layer"):
            w.register_kv_caches(
                {f"model.layers.{i}.attn": torch.zeros(4, 2, 16, 8) for i in (0, 1)}
            )
    finally:
        w.shutdown()


def cache_dtypes() -> list[str]:
    from vllm.config.cache import CacheDType

    return list(typing.get_args(CacheDType))


def test_every_kv_cache_dtype_vllm_accepts_is_told_apart_or_refused():
    """Every 8-bit format is uint8 in the tensors; the identity used to say uint8 for all."""
    seen: dict[str, str] = {}
    refused = []
    for name in cache_dtypes():
        tensor = "uint8" if name not in ("auto", "float16", "bfloat16") else "bfloat16"
        try:
            ident = kv_dtype_identity(name, tensor)
        except UnsupportedConfig as exc:
            assert f"--kv-cache-dtype {name}" in str(exc)
            refused.append(name)
            continue
        if tensor == "uint8":
            assert ident not in seen, (name, seen.get(ident))  # no two formats share pages
            seen[ident] = name
    assert {"fp8", "fp8_e4m3", "fp8_e5m2"} <= set(seen)
    assert {"int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"} <= set(refused)
    assert kv_dtype_identity("auto", "float32") == kv_dtype_identity("float32", "float32")
    assert kv_dtype_identity("fp8", "uint8", ("0", "2")) != kv_dtype_identity("fp8", "uint8")


def test_fp8_variants_get_different_namespaces_and_per_token_head_is_refused(vllm_config_of):
    from vllm_kvdisk.connector.wiring import engine_fingerprint

    cfgs = {d: kv_cache_config(range(4), dtype=torch.uint8) for d in ("fp8_e4m3", "fp8_e5m2")}
    e4, _ = engine_fingerprint(vllm_config_of("fp8_e4m3"), cfgs["fp8_e4m3"], tp_rank=0)
    e5, _ = engine_fingerprint(vllm_config_of("fp8_e5m2"), cfgs["fp8_e5m2"], tp_rank=0)
    assert e4.dirname() != e5.dirname() and (e4.kv_dtype, e5.kv_dtype) == ("fp8_e4m3", "fp8_e5m2")
    with pytest.raises(UnsupportedConfig, match="int8_per_token_head"):
        engine_fingerprint(
            vllm_config_of("int8_per_token_head"),
            kv_cache_config(range(4), dtype=torch.int8),
            tp_rank=0,
        )


def test_decode_context_parallel_is_refused_with_the_setting_named(vllm_config_of):
    from vllm_kvdisk.connector.wiring import engine_fingerprint

    cfg = vllm_config_of(tensor_parallel_size=2)
    cfg.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(UnsupportedConfig, match="--decode-context-parallel-size 2"):
        engine_fingerprint(cfg, kv_cache_config(range(4)), tp_rank=0)


# -- 4. replicated KV: one rank writes, every rank reads ------------------------------------
def test_replicas_share_one_shard():
    assert tp_replicas(2, 1, mla=False) == 2  # one KV head, two ranks
    assert tp_replicas(4, 8, mla=False) == 1
    assert tp_replicas(4, 1, mla=True) == 4
    assert [kv_shard(r, 4, 2) for r in range(4)] == [
        Shard(0, 2, True),
        Shard(0, 2, False),
        Shard(1, 2, True),
        Shard(1, 2, False),
    ]
    with pytest.raises(UnsupportedConfig):
        kv_shard(0, 4, 3)


def test_mla_ranks_share_a_namespace(vllm_config_of):
    from vllm_kvdisk.connector.wiring import engine_fingerprint

    cfg = vllm_config_of(tensor_parallel_size=2)
    kvc = kv_cache_config(range(4), mla=True, tp_size=2)
    assert kvc.kv_tp_replicas == tp_replicas(2, 1, mla=True) == 2  # vLLM's count and ours
    r0, p0 = engine_fingerprint(cfg, kvc, tp_rank=0)
    r1, p1 = engine_fingerprint(cfg, kvc, tp_rank=1)
    assert r0.dirname() == r1.dirname() and (p0.shard.writer, p1.shard.writer) == (True, False)
    # A backend that does not publish its shard count: the model's MLA still says it.
    kvc.kv_tp_replicas = 1
    assert engine_fingerprint(cfg, kvc, tp_rank=1)[1].shard == Shard(0, 1, False)


@pytest.mark.parametrize("replicated", [False, True])
def test_replicated_pages_are_written_once_and_read_by_every_rank(tmp_path, replicated):
    """Two ranks with identical pages (MLA, fewer KV heads than ranks). Before: each wrote
    its own copy (TP x the disk bytes). Now the shard's first rank writes, both read."""
    block = 16
    torch.manual_seed(1)
    caches = {f"model.layers.{i}.attn": torch.rand(NUM_BLOCKS, 1, block, 8) for i in range(2)}
    ranks = []
    for rank in range(2):
        shard = kv_shard(rank, 2, 2 if replicated else 1)
        fp = Fingerprint("m", "0", "float32", "cpu:test/1", block, 2, shard.index)
        w = worker(tmp_path, block, Placement(tp_rank=rank, shard=shard), fp, name="shared")
        w.register_kv_caches({k: v.clone() for k, v in caches.items()})
        ranks.append(w)
    try:
        sha1 = [save(w, [0, 1, 2, 3]) for w in ranks][0]
        files = sorted((tmp_path / "shared").rglob("*.kv"))
        disk = sum(f.stat().st_size for f in files)
        assert len(files) == (1 if replicated else 2), files
        per_token = disk / (4 * block)
        print(f"disk bytes per token at TP 2, replicated={replicated}: {per_token:.0f}")
        for w in ranks:  # each rank restores the shard's one file into other blocks
            assert load(w, sha1, 4 * block, [8, 9, 10, 11]) == []
            for t in w.mover._layers:
                assert torch.equal(t[8:12], t[0:4])
    finally:
        for w in ranks:
            w.shutdown()


# -- 6. the CUDA calls of a page copy, in order (recorded: no GPU here) ---------------------
class RecordingStreams:
    """Stands in for ``transfer.CudaStreams`` and records what the copies ask of it."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    def enter_thread(self) -> None:
        import threading

        self.calls.append(f"set_device@{threading.current_thread().name}")

    def mark(self) -> str:
        self.calls.append("event recorded on compute")
        return "event"

    def after_compute(self, event=None) -> None:
        self.calls.append("side waits on compute" if event is None else f"side waits on {event}")

    def on_side(self):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.calls.append("enter side")
            yield
            self.calls.append("exit side")

        return ctx()

    def finish(self) -> None:
        self.calls.append("synchronize side")


def test_device_copies_order_their_cuda_calls(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from vllm_kvdisk.connector import transfer

    calls: list[str] = []
    layers = [torch.rand(8, 2, 16, 4) for _ in range(2)]
    mover = transfer.PageMover(
        layers, 16, "cuda:test", host_copies=False, streams=RecordingStreams(calls)
    )
    real_index = transfer.PageMover._index
    monkeypatch.setattr(
        transfer.PageMover,
        "_index",
        lambda self, ids: calls.append("block ids to device") or real_index(self, ids),
    )
    real_copy = torch.Tensor.index_copy_
    monkeypatch.setattr(
        torch.Tensor,
        "index_copy_",
        lambda self, *a: calls.append("index_copy_") or real_copy(self, *a),
    )
    pages = np.random.default_rng(0).integers(0, 255, 2 * mover.page_bytes, dtype=np.uint8)
    with ThreadPoolExecutor(1, thread_name_prefix="io") as pool:
        pool.submit(mover.scatter, 1, [3, 5], pages).result()
    assert calls == [
        "set_device@io_0",
        "side waits on compute",
        "enter side",
        "block ids to device",
        "index_copy_",
        "exit side",
        "synchronize side",
    ]
    assert layers[1][[3, 5]].numpy().tobytes() == pages.tobytes()
    calls.clear()
    # A save: the engine thread marks the end of the forward; the copy thread copies after it.
    after = mover.mark()
    out = [np.empty(2 * mover.page_bytes, dtype=np.uint8) for _ in layers]
    with ThreadPoolExecutor(1, thread_name_prefix="copy") as pool:
        pool.submit(mover.gather, [3, 5], out, after).result()
    assert calls == [
        "event recorded on compute",
        "set_device@copy_0",
        "side waits on event",
        "enter side",
        "block ids to device",
        "exit side",
        "synchronize side",
    ]
    assert out[1].tobytes() == pages.tobytes()


def test_device_copies_take_at_most_a_bounded_piece_of_device_memory(monkeypatch):
    """The temporary a device gather (index_select) or scatter (the upload) makes is a piece
    of at most DEVICE_TRANSIENT_BYTES, not a whole layer of the request's pages: it sits
    outside vLLM's memory profile. The pages still land byte for byte."""
    from vllm_kvdisk.connector import transfer

    calls: list[str] = []
    layers = [torch.rand(16, 2, 16, 4) for _ in range(2)]
    mover = transfer.PageMover(
        layers, 16, "cuda:test", host_copies=False, streams=RecordingStreams(calls)
    )
    monkeypatch.setattr(transfer, "DEVICE_TRANSIENT_BYTES", 2 * mover.page_bytes)
    pieces: list[int] = []
    real_select = torch.index_select
    monkeypatch.setattr(
        torch,
        "index_select",
        lambda t, dim, idx: pieces.append(len(idx)) or real_select(t, dim, idx),
    )
    ids = [9, 3, 4, 12, 0]
    before = [t[ids].clone() for t in layers]
    out = [np.empty(len(ids) * mover.page_bytes, dtype=np.uint8) for _ in layers]
    mover.gather(ids, out)
    assert pieces == [2, 2, 1] * len(layers)
    assert [o.tobytes() for o in out] == [b.numpy().tobytes() for b in before]
    uploads: list[int] = []
    real_copy = torch.Tensor.index_copy_
    monkeypatch.setattr(
        torch.Tensor,
        "index_copy_",
        lambda self, dim, idx, src: uploads.append(len(src)) or real_copy(self, dim, idx, src),
    )
    pages = np.random.default_rng(1).integers(0, 255, len(ids) * mover.page_bytes, dtype=np.uint8)
    mover.scatter(1, ids, pages)
    assert uploads == [2, 2, 1]
    assert layers[1][ids].numpy().tobytes() == pages.tobytes()
    assert layers[0][ids].numpy().tobytes() == before[0].numpy().tobytes()


# -- 7. found while reading -----------------------------------------------------------------
def test_the_worker_store_gets_the_configured_lock_timeout(tmp_path):
    """``--kv-disk-lock-timeout-s`` reached only the scheduler; saves waited 10 s."""
    w = worker(tmp_path, 16, Placement())
    try:
        assert w.store.lock_timeout_s == 3
    finally:
        w.shutdown()


def test_files_record_the_shard_they_hold(tmp_path):
    """Every file used to say TP 0/1, whatever the rank."""
    from vllm_kvdisk.storage.fileread import read_meta

    fp = Fingerprint("m", "0", "float32", "cpu:test/1", 16, 2, 1)
    w = worker(tmp_path, 16, Placement(tp_rank=1, shard=kv_shard(1, 2, 1)), fp)
    w.register_kv_caches({"l0": torch.rand(NUM_BLOCKS, 2, 16, 8)})
    try:
        sha1 = save(w, [0, 1])
        path = tmp_path / "kv" / fp.dirname() / f"{sha1}.kv"
        with open(path, "rb") as f:
            meta = read_meta(f.fileno(), path.stat().st_size)
        assert (meta.payload.layout.tp_rank, meta.payload.layout.tp_size) == (1, 2)
    finally:
        w.shutdown()


def test_an_engine_with_another_kernel_split_misses_without_quarantining(tmp_path):
    """Engines whose backends split blocks differently share a namespace (the scheduler
    cannot know the worker's kernel block); their pages have other shapes. The other's file
    is a miss for each, never restored and never quarantined as corrupt."""
    block = 64
    views = split_views("LBHNC", block, 32)
    for v in views.values():
        v.copy_(torch.randn(v.shape))
    split = worker(tmp_path, block, Placement(num_blocks=NUM_BLOCKS, layer_names=tuple(views)))
    split.register_kv_caches(views)
    sha1 = save(split, [0, 1])
    whole = worker(tmp_path, block, Placement(num_blocks=NUM_BLOCKS))
    whole.register_kv_caches({k: torch.zeros(NUM_BLOCKS, 2, block, 8) for k in views})
    try:
        before = [t.clone() for t in whole.mover._layers]
        assert load(whole, sha1, 2 * block, [4, 5]) == [4, 5]  # recomputed
        assert all(torch.equal(t, b) for t, b in zip(whole.mover._layers, before))
        assert list((tmp_path / "kv").rglob(f"{sha1}.kv")), "a sound file was quarantined"
        assert load(split, sha1, 2 * block, [4, 5]) == []  # still the split engine's hit
    finally:
        split.shutdown()
        whole.shutdown()
