"""Pieces the benchmark scripts share: the random model's shape and an engine to drive.

Scripts import it as ``common`` (a script's own directory is on ``sys.path``). vLLM is
imported inside the functions, so a script can set vLLM's environment variables first.
"""

from __future__ import annotations

import gc


def model_shape(hidden: int, layers: int) -> dict[str, int]:
    """A random Llama shape for vllm_kvdisk.tinymodel: 64-dim heads, one KV head per 4."""
    return {"hidden": hidden, "layers": layers, "heads": hidden // 64,
            "kv_heads": max(1, hidden // 256)}


def kv_bytes_per_token(shape: dict[str, int]) -> int:
    """K and V, every layer, fp32."""
    return 2 * shape["layers"] * shape["kv_heads"] * 64 * 4


def make_llm(model: str, kv_dir: str | None, **extra):
    """An engine on ``model`` (fp32, eager, prefix caching on), with kvdisk on ``kv_dir``
    (a small grid for prompts of a few thousand tokens; ``extra`` adds config keys)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = {}
    if kv_dir:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="kvdisk", kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"kv_disk_dir": kv_dir, "kv_cache_min_tokens": 128,
                                       "kv_cache_boundary_align_tokens": 256, **extra})
    return LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=16384,
               enable_prefix_caching=True, **kwargs)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
