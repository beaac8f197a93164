"""Which engine configurations kvdisk serves exactly, and what tells their pages apart.

A page is restored byte for byte, so everything that changes what its bytes mean must be
in the namespace identity, and a configuration whose pages kvdisk cannot copy whole (or
whose block arithmetic it does not follow) must be refused at start-up, never run wrong:

* **KV dtype.** Every 8-bit format is ``uint8`` in the cache tensors, so the identity is
  vLLM's ``--kv-cache-dtype`` string, not the tensor dtype. Formats whose scales live
  outside the tensors a connector is handed (per-token-head scales sit in separate scale
  caches) or whose packed page format is not verified are refused.
* **Parallelism.** A pipeline stage holds only its layers: stage and layer range are part
  of the identity. Decode/prefill context parallelism shards a block's tokens across
  ranks (a block then covers ``block_size x dcp`` tokens): refused.
* **KV cache groups (hybrid models).** With vLLM's hybrid KV cache manager a model has one
  group per layer type, each with its own block table. Full-attention groups and
  sliding-window groups are served (a window group's checkpoint holds the window a hit at
  its position needs), and so are Mamba / linear-attention (Gated-DeltaNet) state groups
  in vLLM's "align" mode beside attention (a checkpoint holds the state after its last
  token: vLLM keeps one per block there, padded to the attention page). Every other kind
  is refused, as are attention groups whose pages differ in shape, dtype or block size and
  state groups whose block or page size is not the attention groups'.
* **Replicated KV.** MLA's latent cache, and GQA with fewer KV heads than TP ranks, give
  several ranks identical pages: those ranks share one namespace (the KV *shard*), one of
  them writes it and all of them read it.

Pure: the wiring reads plain values out of vLLM's config and calls these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvdisk.core.format import Group, GroupKind

# --kv-cache-dtype values whose pages hold everything a restore needs. "auto" and the
# float names are the model's own dtype; fp8 per-tensor formats keep their scales in the
# model's weights (part of the model identity), not per page.
FLOAT_DTYPES = ("auto", "float16", "bfloat16", "float32")
FP8_PER_TENSOR = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")


class UnsupportedConfig(ValueError):
    """An engine setting kvdisk cannot serve exactly; the message names it."""


def check_kv_dtype(cache_dtype: str) -> None:
    """Refuse a ``--kv-cache-dtype`` whose pages do not hold everything a restore needs."""
    if cache_dtype in FLOAT_DTYPES or cache_dtype in FP8_PER_TENSOR:
        return
    if cache_dtype.endswith("per_token_head"):
        raise UnsupportedConfig(
            f"kvdisk: --kv-cache-dtype {cache_dtype} keeps its per-token-head scales in "
            "separate scale caches that a KV connector is not handed, so a restored page "
            "would be read with another request's scales. Use --kv-cache-dtype fp8_e4m3 "
            "(or auto), or run without kvdisk."
        )
    raise UnsupportedConfig(
        f"kvdisk: --kv-cache-dtype {cache_dtype} is not supported: its packed page format "
        "(scales beside the values) is not verified to restore exactly. Use "
        "--kv-cache-dtype fp8_e4m3 / fp8_e5m2 or auto, or run without kvdisk."
    )


def kv_dtype_identity(
    cache_dtype: str, tensor_dtype: str, skip_layers: tuple[str, ...] = ()
) -> str:
    """The KV dtype part of the namespace identity, or UnsupportedConfig.

    ``tensor_dtype`` is the cache tensors' dtype name (``float32``, ``uint8``, ...)."""
    cache_dtype = str(cache_dtype or "auto")
    check_kv_dtype(cache_dtype)
    if cache_dtype in FLOAT_DTYPES:
        return tensor_dtype
    ident = cache_dtype
    if skip_layers:  # those layers keep the model dtype: another page mix
        ident += "+skip:" + ",".join(sorted(skip_layers))
    return ident


def check_sleep_mode(enabled: bool) -> None:
    """Sleep mode releases the KV cache memory and remaps it on wake-up, while kvdisk's
    worker threads hold views of the tensors it registered and copy pages after a step.
    vLLM 0.33+ refuses the pair itself (``supports_sleep_mode`` is False); 0.32 does not
    ask, so kvdisk refuses it here."""
    if enabled:
        raise UnsupportedConfig(
            "kvdisk: --enable-sleep-mode releases and remaps the KV cache, which kvdisk's "
            "copies (views of the registered tensors) do not follow. Run without sleep "
            "mode, or without kvdisk."
        )


def check_context_parallel(dcp_size: int, pcp_size: int) -> None:
    if dcp_size > 1 or pcp_size > 1:
        which = (
            "--decode-context-parallel-size" if dcp_size > 1 else "--prefill-context-parallel-size"
        )
        raise UnsupportedConfig(
            f"kvdisk: {which} {max(dcp_size, pcp_size)} shards each block's tokens across "
            "ranks (a block then covers block_size x the context-parallel size tokens), "
            "which kvdisk's checkpoint arithmetic does not follow. Run with "
            f"{which} 1, or without kvdisk."
        )


@dataclass(frozen=True, slots=True)
class Shard:
    """Which KV shard a TP rank holds, and whether it writes that shard's files."""

    index: int  # the namespace's tp_rank: ranks with equal pages share it
    count: int
    writer: bool


def tp_replicas(tp_size: int, total_kv_heads: int, *, mla: bool) -> int:
    """How many consecutive TP ranks hold identical KV, for a vLLM that does not say it
    (``KVCacheConfig.kv_tp_replicas``): MLA replicates the latent on every rank; GQA with
    fewer KV heads than ranks gives each head ``tp_size // total_kv_heads`` ranks
    (``QKVParallelLinear``: rank r holds head ``r // replicas``)."""
    if mla:
        return tp_size
    return max(1, tp_size // max(1, total_kv_heads))


def kv_shard(tp_rank: int, tp_size: int, replicas: int) -> Shard:
    """The KV shard of ``tp_rank`` when ``replicas`` consecutive ranks hold equal pages:
    they share the shard's namespace, and the first of them writes it."""
    if not 0 <= tp_rank < tp_size:
        raise UnsupportedConfig(f"kvdisk: TP rank {tp_rank} outside 0..{tp_size - 1}")
    if replicas < 1 or tp_size % replicas:
        raise UnsupportedConfig(
            f"kvdisk: {replicas} KV replicas do not divide --tensor-parallel-size {tp_size}"
        )
    return Shard(tp_rank // replicas, tp_size // replicas, tp_rank % replicas == 0)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a worker sits in the engine: its ranks, its KV shard, the layers it holds."""

    tp_rank: int = 0
    pp_rank: int = 0
    shard: Shard = Shard(0, 1, True)
    layer_names: tuple[str, ...] = ()  # empty: not checked
    num_blocks: int = 0  # the scheduler's blocks (kernel blocks are grouped into these)
    groups: tuple[Group, ...] = (Group(GroupKind.FULL, 0),)  # the KV cache groups served
    group_layers: tuple[tuple[str, ...], ...] = ()  # each group's layers (several groups)


def layer_range(names: list[str]) -> str:
    """What a pipeline stage's files hold: its first and last KV layer, by name."""
    if not names:
        raise UnsupportedConfig("kvdisk: this worker holds no KV cache layers")
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


# vLLM KV cache spec classes (by name) and why kvdisk refuses them.
_REFUSED_SPECS = {
    "ChunkedLocalAttentionSpec": "uses chunked local attention, whose block arithmetic kvdisk "
    "does not follow",
    "CrossAttentionSpec": "is an encoder-decoder cross-attention cache (per request, not a prefix)",
}


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """What the wiring reads of one vLLM KV cache group (plain values)."""

    spec: str  # the spec's class name
    layers: int
    block_size: int
    page: tuple[Any, ...]  # anything that tells the pages apart: (dtype, kv heads, head sizes)
    full: bool = False  # a FullAttentionSpec (MLA included)
    window: int = 0  # a SlidingWindowSpec's window plus its retained tokens
    # A MambaSpec: its cache mode, speculative blocks, and its state tensors' shapes and
    # dtypes (what tells two models' states apart: part of the namespace).
    state_mode: str = ""
    state: tuple[Any, ...] = ()
    speculative_blocks: int = 0
    page_bytes: int = 0  # the group's page (a state group's padded to the attention page)


def _state_group(i: int, g: GroupInfo) -> Group:
    if g.state_mode != "align":
        raise UnsupportedConfig(
            f"kvdisk: KV cache group {i} keeps Mamba / linear-attention states in vLLM's "
            f"mamba cache mode {g.state_mode or 'none'!r}, where vLLM keeps no state at block "
            "boundaries to checkpoint. Run with prefix caching on (--enable-prefix-caching, "
            "which picks --mamba-cache-mode align), or without kvdisk."
        )
    if g.speculative_blocks:
        raise UnsupportedConfig(
            f"kvdisk: KV cache group {i} keeps {g.speculative_blocks} speculative Mamba state "
            "block(s) (speculative decoding on a linear-attention model), which kvdisk does "
            "not checkpoint. Run without speculative decoding, or without kvdisk."
        )
    return Group(GroupKind.STATE, g.layers)


def kv_groups(groups: list[GroupInfo]) -> tuple[Group, ...]:
    """The groups kvdisk serves, in vLLM's order, or UnsupportedConfig naming the group."""
    if not groups:
        raise UnsupportedConfig("kvdisk: the model has no KV cache group")
    out = []
    for i, g in enumerate(groups):
        if g.full:
            out.append(Group(GroupKind.FULL, g.layers))
        elif g.window > 0:
            out.append(Group(GroupKind.WINDOW, g.layers, window=g.window))
        elif g.spec == "MambaSpec":
            out.append(_state_group(i, g))
        else:
            why = _REFUSED_SPECS.get(
                g.spec,
                f"has a {g.spec} KV cache that kvdisk does not know how to checkpoint exactly",
            )
            raise UnsupportedConfig(
                f"kvdisk: KV cache group {i} of this model {why}. kvdisk serves full-attention "
                "and sliding-window layers and Mamba / linear-attention states only; run this "
                "model without kvdisk."
            )
    attention = [
        (i, g) for (i, g), kind in zip(enumerate(groups), out) if kind.kind != GroupKind.STATE
    ]
    if not attention:
        raise UnsupportedConfig(
            "kvdisk: this model keeps only Mamba / linear-attention states (no attention "
            "layer), which kvdisk does not checkpoint. Run it without kvdisk."
        )
    f, first = attention[0]
    for i, g in attention[1:]:
        if (g.block_size, g.page) != (first.block_size, first.page):
            raise UnsupportedConfig(
                f"kvdisk: KV cache group {i} has pages of block size {g.block_size} / "
                f"{g.page}, group {f} of {first.block_size} / {first.page}; kvdisk needs every "
                "group to have the same page geometry. Run this model without kvdisk."
            )
    for i, g in enumerate(groups):
        if out[i].kind == GroupKind.STATE and (g.block_size, g.page_bytes) != (
            first.block_size,
            first.page_bytes,
        ):
            raise UnsupportedConfig(
                f"kvdisk: KV cache group {i} keeps states in blocks of {g.block_size} tokens "
                f"and pages of {g.page_bytes} bytes, the attention groups in blocks of "
                f"{first.block_size} and pages of {first.page_bytes}; kvdisk needs vLLM's "
                "aligned layout (one state per attention block, pages of one size). Run this "
                "model without kvdisk."
            )
    return tuple(out)


def groups_signature(groups: tuple[Group, ...], states: tuple[str, ...] = ()) -> str:
    """The groups' part of the namespace layout ('' for one full-attention group, so such
    an engine's layout string is the one it always had). ``states``: per state group, its
    state tensors' shapes and dtypes (``state_signature``). A window group is ``wd``: its
    files leave the window blocks their parent's chain holds to it (``format.window_held``),
    which a build from before reads as corrupt; ``w`` (files that always store their whole
    window) was that build's, so the two never share a namespace."""
    if len(groups) == 1 and groups[0].kind == GroupKind.FULL:
        return ""
    if len(states) != sum(g.kind == GroupKind.STATE for g in groups):
        raise ValueError("one state signature per state group is needed")
    state = iter(states)
    parts = []
    for g in groups:
        if g.kind == GroupKind.WINDOW:
            parts.append(f"wd{g.window}x{g.layers}")
        elif g.kind == GroupKind.STATE:
            parts.append(f"s{g.layers}[{next(state)}]")
        else:
            parts.append(f"fx{g.layers}")
    return "/G" + ",".join(parts)


def state_signature(state: tuple[Any, ...]) -> str:
    """A state group's tensors as text: ``((3, 1024), 'bfloat16'), ...`` ->
    ``3x1024:bfloat16+...``."""
    return "+".join("x".join(str(d) for d in shape) + f":{dtype}" for shape, dtype in state)
