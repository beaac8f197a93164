"""The trace says why: each decision provoked on a real engine and read back."""

import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from engine import engine, generate, random_prompt, trace_lines
from vllm_kvdisk.tokens import table_from_tokenizer

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
        assert "reason: below min tokens" in trace_lines(trace, "miss for")[-1]

        generate(llm, a[:700])
        assert "reason: no checkpoint" in trace_lines(trace, "miss for")[-1]
        assert re.search(r"saved reason=cold sha1=[0-9a-f]{40} tokens=640 bytes=\d+ ms=\d+",
                         trace_lines(trace, "saved")[-1])

        generate(llm, a)  # the device cache holds 640; a delta checkpoint at 1408 follows
        assert "device hit" in trace_lines(trace, "device hit")[-1]

        llm.reset_prefix_cache()
        b = a[:1000] + random_prompt(500, seed=21)
        generate(llm, b)
        line = [x for x in trace_lines(trace, "hit for") if "restoring" in x][-1]
        assert "restoring 640 tokens from 1 file(s)" in line
        at = int(re.search(r"prefix mismatch at byte (\d+)", line).group(1))
        assert len(table.render(np.array(a[:1000]))[0]) <= at < len(table.render(np.array(a[:1408]))[0])

        llm.reset_prefix_cache()
        c, split_at = same_text_other_tokens(table, a, 700, 1400)
        assert table.render(np.array(c))[0] == table.render(np.array(a))[0]
        tokens_c, cached = generate(llm, c)
        assert cached == 640  # the 1408 checkpoint has the same text but other tokens
        line = [x for x in trace_lines(trace, "hit for") if "restoring" in x][-1]
        assert f"text equal but tokens differ at token {split_at}" in line
        assert re.search(r"loaded 640 tokens from 1 file\(s\), \d+ ms", open(trace).read())


def test_evictions_are_traced(tiny_model, tmp_path):
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    with engine(tiny_model, kv, trace=trace, kv_disk_space_mb=6) as llm:
        for seed in range(3):  # 640-token checkpoints of ~2.6 MB each
            generate(llm, random_prompt(700, seed=30 + seed))
    evicted = trace_lines(trace, "evicted")
    saved = trace_lines(trace, "saved")
    assert len(saved) == 3 and len(evicted) == 1
    first = saved[0].split("sha1=")[1].split()[0]
    assert f"evicted sha1={first}" in evicted[0]  # the oldest leaf goes first
