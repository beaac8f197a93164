"""What a request and an operator may ask of a running engine: per-request control of
loads and saves, and clearing the disk cache with the device cache."""

import json
import os

import pytest
from engine import engine, events, generate, random_prompt, wait_events
from helpers import kv_files

pytestmark = pytest.mark.engine


def test_per_request_control_skips_saves_caps_them_and_skips_loads(tiny_model, tmp_path):
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    a, b = random_prompt(1500, seed=60), random_prompt(1500, seed=61)
    with engine(tiny_model, kv, trace=trace) as llm:
        generate(llm, a, kv_params={"kvdisk": {"save": False}})
        assert kv_files(kv) == []  # nothing of this request was written
        generate(llm, b, kv_params={"kvdisk": {"max_save_tokens": 640}})
        saved = wait_events(trace, "saved")
        assert saved and max(e.tokens for e in saved) <= 640
        llm.reset_prefix_cache()
        _, cached = generate(llm, b, kv_params={"kvdisk": {"load": False, "save": False}})
        assert cached == 0  # on disk, but this request asked not to load
        assert "loading skipped by the request" in events(trace, "miss")[-1].detail
        llm.reset_prefix_cache()
        _, cached = generate(llm, b)
        assert cached == 640  # the capped checkpoint serves the next request


def test_reset_with_the_connector_clears_this_models_checkpoints_only(tiny_model, tmp_path):
    kv = str(tmp_path / "kv")
    prompt = random_prompt(1000, seed=62)
    foreign = os.path.join(kv, "0123456789abcdef")
    with engine(tiny_model, kv) as llm:
        reference, _ = generate(llm, prompt)
        assert kv_files(kv)
        os.makedirs(foreign)  # another model's namespace on the same volume
        with open(os.path.join(foreign, "namespace.json"), "w") as fh:
            json.dump({"model": "someone-else", "revision": "x"}, fh)
        assert llm.reset_prefix_cache(reset_connector=True)
        assert kv_files(kv) == [] and os.path.isdir(foreign)
        tokens, cached = generate(llm, prompt)
        assert cached == 0 and tokens == reference  # recomputed, still exact
        assert kv_files(kv)  # and checkpointed again
