"""Hostile kv_transfer_params through a real engine: answered, exact, and the engine idles.

A client controls ``kv_transfer_params``. A lone surrogate (``"\\ud800"``, valid JSON) in
the tool map once raised inside the step that had just reserved a save: the reservation
was never released, ``has_pending_push_work()`` stayed true, and the engine stepped empty
batches forever.
"""

import pytest
from engine import engine, generate, random_prompt

pytestmark = pytest.mark.engine


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = [
    {"kvdisk_tool_map": [["\ud800", "text"]]},
    {"kvdisk_tool_map": [["chatcmpl-tool-1", "a \udfff b"], ["ok-id", "ok text"]]},
    {"kvdisk": {"max_save_tokens": 2**64 - 1}},  # vLLM refuses larger ints itself
    {"kvdisk": {"max_save_tokens": 1e308, "load": "\ud800", "\ud800": -(2**63)}},
    {"kvdisk": {"save": [1, {"a": None}], "load": 1}, "kvdisk_tool_map": {"a": "b"}},
    {"kvdisk": nested(200), "kvdisk_tool_map": nested(200)},  # vLLM deep-copies params
    {"kvdisk": "\ud800", "kvdisk_tool_map": [[1, 2], ["x"], "\ud800", None, 2**64 - 1]},
]


def drain(llm, max_steps: int = 20_000) -> int:
    """Step the engine with no requests left until it has nothing to do (saves in flight
    reported), as vLLM's busy loop does; the steps it took. A leaked reservation makes it
    step forever: the bound turns that into a failure."""
    import time

    core = llm.llm_engine.engine_core.engine_core
    for step in range(max_steps):
        if not core.scheduler.has_requests():
            return step
        core.step()
        time.sleep(0.005)  # leave the I/O threads the GIL: not part of any verdict
    return max_steps


def test_hostile_kv_transfer_params_are_answered_exactly_and_the_engine_goes_idle(
    tiny_model, tmp_path
):
    prompts = [random_prompt(400, seed=300 + i) for i in range(len(HOSTILE))]
    with engine(tiny_model, None, prefix_caching=False) as llm:
        references = [generate(llm, p, max_tokens=8)[0] for p in prompts]
    with engine(tiny_model, str(tmp_path / "kv")) as llm:
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        for prompt, params, reference in zip(prompts, HOSTILE, references):
            tokens, _ = generate(llm, prompt, max_tokens=8, kv_params=params)
            assert tokens == reference, params
            assert drain(llm) < 20_000 and not connector.has_pending_push_work(), params
        # and the cache still works for everyone: the first prompt restores from disk
        llm.reset_prefix_cache()
        tokens, cached = generate(llm, prompts[0], max_tokens=8)
        assert tokens == references[0] and cached == 384
