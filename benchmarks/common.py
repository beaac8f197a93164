"""Pieces the benchmark scripts share: the random model's shape and an engine to drive.

Scripts import it as ``common`` (a script's own directory is on ``sys.path``). Engines and
servers come from the shared harness (``vllm_kvdisk.testing.harness``, the tests use it too);
vLLM is imported when one is built, so a script can set vLLM's environment first.
"""

from __future__ import annotations

from vllm_kvdisk.testing.harness import close
from vllm_kvdisk.testing.harness import make_llm as _make_llm

__all__ = ["close", "kv_bytes_per_token", "make_llm", "model_shape"]


def model_shape(hidden: int, layers: int) -> dict[str, int]:
    """A random Llama shape for vllm_kvdisk.testing.tinymodel: 64-dim heads, one KV head per 4."""
    return {
        "hidden": hidden,
        "layers": layers,
        "heads": hidden // 64,
        "kv_heads": max(1, hidden // 256),
    }


def kv_bytes_per_token(shape: dict[str, int]) -> int:
    """K and V, every layer, fp32."""
    return 2 * shape["layers"] * shape["kv_heads"] * 64 * 4


def make_llm(model: str, kv_dir: str | None, **extra):
    """An engine on ``model`` (fp32, eager, prefix caching on), with kvdisk on ``kv_dir``
    (ds4's default grid, checkpoints from 128 tokens; ``extra`` adds config keys)."""
    cfg = {"kv_cache_min_tokens": 128, **extra} if kv_dir else {}
    return _make_llm(model, kv_dir, max_model_len=16384, **cfg)
