"""The trace says why: each decision provoked on a real engine and read back."""

import re

import numpy as np
import pytest
from engine import engine, events, generate, random_prompt, wait_events
from transformers import AutoTokenizer

from vllm_kvdisk.core.tokens import table_from_tokenizer

pytestmark = pytest.mark.engine


def same_text_other_tokens(table, ids: list[int], lo: int, hi: int) -> tuple[list[int], int]:
    """ids with one adjacent pair re-split into other tokens of the same bytes."""
    rev = {table.piece(i): i for i in range(len(table))}
    for i in range(lo, hi):
        joined = table.piece(ids[i]) + table.piece(ids[i + 1])
        for k in range(1, len(joined)):
            x, y = rev.get(joined[:k]), rev.get(joined[k:])
            if x is not None and y is not None and (x, y) != (ids[i], ids[i + 1]):
                out = list(ids)
                out[i], out[i + 1] = x, y
                return out, i
    raise AssertionError("no re-splittable pair in the prompt")


def test_each_decision_is_traced_with_its_reason(tiny_model, tmp_path):
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    table = table_from_tokenizer(AutoTokenizer.from_pretrained(tiny_model))
    a = random_prompt(1500, seed=20)
    with engine(tiny_model, kv, trace=trace) as llm:
        generate(llm, a[:100])
        assert "below min tokens" in events(trace, "miss")[-1].detail

        generate(llm, a[:700])
        assert "no checkpoint" in events(trace, "miss")[-1].detail
        saved = wait_events(trace, "saved")[-1]
        assert (saved.reason, saved.tokens) == ("cold", 640) and saved.bytes > 0

        generate(llm, a)  # the device cache holds 640; a delta checkpoint at 1408 follows
        assert events(trace, "device_hit")

        llm.reset_prefix_cache()
        b = a[:1000] + random_prompt(500, seed=21)  # leaves a's 1408 file at token 1000
        _, cached = generate(llm, b)
        assert cached == 896  # the last whole block before the divergence, inside the file
        hit = wait_events(trace, "hit")[-1]
        assert (hit.tokens, hit.files) == (896, 2) and "used up to token 896 of 1408" in hit.detail
        at = int(re.search(r"prefix mismatch at byte (\d+)", hit.detail).group(1))
        assert (
            len(table.render(np.array(a[:1000]))[0])
            <= at
            < len(table.render(np.array(a[:1408]))[0])
        )

        llm.reset_prefix_cache()
        c, split_at = same_text_other_tokens(table, a, 700, 1400)
        assert table.render(np.array(c))[0] == table.render(np.array(a))[0]
        tokens_c, cached = generate(llm, c)
        # The 1408 checkpoint has the same text but other tokens from split_at on.
        assert cached == max(640, split_at - split_at % 128)
        hit = wait_events(trace, "hit", 2)[-1]
        assert f"text equal but tokens differ at token {split_at}" in hit.detail
        assert all(e.tokens > 0 and e.ms >= 0 for e in events(trace, "loaded"))


def test_evictions_are_traced(tiny_model, tmp_path):
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    with engine(tiny_model, kv, trace=trace, kv_disk_space_mb=6, kv_disk_min_free_mb=0) as llm:
        for seed in range(3):  # 640-token checkpoints of ~2.6 MB each
            generate(llm, random_prompt(700, seed=30 + seed))
    evicted = events(trace, "evicted")
    saved = events(trace, "saved")
    assert len(saved) == 3 and len(evicted) == 1
    assert evicted[0].sha1 == saved[0].sha1  # the oldest leaf goes first
