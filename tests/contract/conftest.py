"""The contract suite: kvdisk with a real vLLM scheduler (``vllm_api`` builds it for the
installed vLLM; ``driver`` steps it with synthesised TP ranks)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def make_engine(tiny_model, tmp_path):
    """``make_engine(tp=1, *, loads=..., copy_steps=1, async_scheduling=False, **kvdisk)``"""
    import vllm_api as api
    from driver import Engine

    made = []

    def make(tp=1, *, loads=None, copy_steps=1, async_scheduling=False, **kvdisk):
        vllm_args = {k: kvdisk.pop(k) for k in ("num_blocks", "state_group") if k in kvdisk}
        config = {
            "kv_cache_boundary_align_tokens": 64,
            "kv_cache_boundary_trim_tokens": 0,
            "kv_cache_min_tokens": 32,
            **kvdisk,
        }
        sched = api.make_scheduler(
            tiny_model,
            str(tmp_path / "kv"),
            tp=tp,
            async_scheduling=async_scheduling,
            **vllm_args,
            **config,
        )
        kw = {"loads": loads} if loads else {}
        engine = Engine(sched, tp, copy_steps=copy_steps, depth=2 if async_scheduling else 1, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.kvdisk.shutdown()
