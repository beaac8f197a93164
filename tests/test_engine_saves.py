"""Save reasons beyond cold: continued checkpoints during long generations, shutdown."""

import json
import threading
import time

import pytest
import requests
from engine import OUTCOME_WAIT_S, Server, engine, events, generate, random_prompt, wait_events

pytestmark = pytest.mark.engine


def test_continued_checkpoints_during_generation_restore_exactly(tiny_model, tmp_path):
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    prompt = random_prompt(1500, seed=11)
    with engine(tiny_model, kv, trace=trace, kv_cache_continued_interval_tokens=512) as llm:
        out, _ = generate(llm, prompt, max_tokens=600)  # computed tokens cross 1536, 2048
        # Saves are asynchronous: the last one may land just after the request returns.
        deadline = time.monotonic() + OUTCOME_WAIT_S
        while (
            not any(e.reason == "continued" for e in events(trace, "saved"))
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        saved = {f"{e.reason}:{e.tokens}" for e in events(trace, "saved")}
        # cold at 1408 (the prompt), continued at the grid position below each frontier.
        assert {"cold:1408", "continued:1920"} <= saved, saved
        resumed = prompt + out[:500]  # the client resends prompt + most of the answer
        llm.reset_prefix_cache()
        tokens, cached = generate(llm, resumed, max_tokens=16)
    assert cached == 1920
    with engine(tiny_model, None, prefix_caching=False) as llm:
        reference, _ = generate(llm, resumed, max_tokens=16)
    assert tokens == reference


def test_sigterm_checkpoints_running_requests_and_the_next_server_resumes(tiny_model, tmp_path):
    """SIGTERM while a request generates: its tokens are checkpointed (``shutdown``) before
    the server exits. The signal is sent once the client has received 300 streamed tokens
    (past the next grid position, 1152) and the request cannot have finished by then (7000
    tokens asked for); the client holds its stream open until the save is in the trace, so
    neither the engine's speed nor a client timeout decides what is running at SIGTERM."""
    kv, trace, log = str(tmp_path / "kv"), str(tmp_path / "trace.txt"), str(tmp_path / "log")
    prompt_ids = random_prompt(1000, seed=12)
    server = Server(tiny_model, kv, log, "--trace", trace)
    past_grid, release = threading.Event(), threading.Event()
    streamed: dict[str, object] = {"tokens": 0}

    def long_request() -> None:
        try:
            with requests.post(
                server.url + "/v1/completions",
                json={
                    "model": tiny_model,
                    "prompt": prompt_ids,
                    "max_tokens": 7000,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_token_ids": True,
                },
                stream=True,
                timeout=(5, OUTCOME_WAIT_S),
            ) as reply:
                for line in reply.iter_lines():
                    if not line.startswith(b"data: {"):
                        continue
                    for choice in json.loads(line[len(b"data: ") :])["choices"]:
                        streamed["tokens"] += len(choice.get("token_ids") or [])
                    if streamed["tokens"] >= 300:
                        past_grid.set()
                    if release.is_set():
                        break  # closing the stream aborts the request: the drain ends
        except requests.RequestException as exc:
            streamed["error"] = exc
        finally:
            past_grid.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    stopped: dict = {}
    stopping = threading.Thread(target=lambda: stopped.update(server.stop()))
    try:
        assert past_grid.wait(OUTCOME_WAIT_S) and streamed["tokens"] >= 300, streamed
        stopping.start()  # SIGTERM; the server drains while the stream is open
        wait_events(trace, "saved", where=lambda e: e.reason == "shutdown")
    finally:
        release.set()
        worker.join(timeout=OUTCOME_WAIT_S)
        if stopping.ident:
            stopping.join(timeout=OUTCOME_WAIT_S)
        else:
            server.stop()
    assert stopped.get("rc") == 0, stopped
    shutdown = [e for e in events(trace, "saved") if e.reason == "shutdown"]
    assert shutdown, open(trace).read()
    tokens = max(e.tokens for e in shutdown)
    assert tokens > 896  # deeper than the prompt's own checkpoint: generated tokens too
    server = Server(tiny_model, kv, log, "--trace", trace)
    try:
        lines_before = len(events(trace, "hit"))
        # Resend the prompt alone: the cold checkpoint (896) hits, and the shutdown one is
        # on disk as a delta on it.
        r = requests.post(
            server.url + "/v1/completions",
            json={"model": tiny_model, "prompt": prompt_ids, "max_tokens": 4, "temperature": 0},
            timeout=120,
        ).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 896
        assert len(events(trace, "hit")) > lines_before
    finally:
        server.stop()


def test_auto_policy_recomputes_when_the_store_is_slow(tiny_model, tmp_path, monkeypatch):
    """A store slower than this engine's prefill makes `auto` recompute after measuring one
    restore. The measurements are injected (a load of 1 KiB/s, a prefill of 1000 tokens/s)
    so the decision never depends on how fast this machine happens to be."""
    from vllm_kvdisk.core.policy import LoadCostModel

    real_load, real_step = LoadCostModel.observe_load, LoadCostModel.observe_step
    monkeypatch.setattr(
        LoadCostModel,
        "observe_load",
        lambda self, nbytes, seconds: real_load(self, nbytes, nbytes / 1024),
    )
    monkeypatch.setattr(
        LoadCostModel,
        "observe_step",
        lambda self, tokens, seconds: real_step(self, tokens, tokens / 1000),
    )
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    first, second = random_prompt(1500, seed=40), random_prompt(1500, seed=41)
    with engine(tiny_model, kv, trace=trace, kv_disk_load_policy="auto") as llm:
        generate(llm, first)
        generate(llm, second)  # both prefills are timed: the policy knows prefill speed
        llm.reset_prefix_cache()
        _, cached_first = generate(llm, first)  # no load measured yet: it loads (slowly)
        llm.reset_prefix_cache()
        tokens, cached_second = generate(llm, second)  # now it knows: recompute
    assert cached_first == 1408 and cached_second == 0
    assert "cheaper to recompute: load" in events(trace, "miss")[-1].detail
    with engine(tiny_model, None, prefix_caching=False) as llm:
        reference, _ = generate(llm, second)
    assert tokens == reference


def test_admission_and_the_write_budget_decide_what_is_written(tiny_model, tmp_path):
    """``repeat``: a one-off start is not written, the second request that begins the same
    way is; a write budget of 1 MiB a day is spent by those files (4 KiB of KV per token
    here), so the next request's saves are skipped and a restore stops at what was
    written, exactly."""
    from helpers import kv_files

    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    prompt = random_prompt(1500, seed=21)
    cfg = {"kv_disk_admission": "repeat", "kv_disk_write_mb_per_day": 1}
    with engine(tiny_model, kv, trace=trace, **cfg) as llm:
        generate(llm, prompt[:700])  # a first start: not written
        generate(llm, prompt[:1100])  # the same start again: grid point 896, tail 1024
        saved = wait_events(trace, "saved", count=2)
        assert sorted(e.tokens for e in saved) == [896, 1024]
        # A step or two without saves brings the written bytes to the budget's account.
        generate(llm, random_prompt(200, seed=22), kv_params={"kvdisk": {"save": False}})
        generate(llm, prompt)  # admitted, but the day's bytes are spent: nothing written
        llm.reset_prefix_cache()
        tokens, cached = generate(llm, prompt)
        assert cached == 1024
    assert len(kv_files(kv)) == 2
    assert not any(e.tokens > 1024 for e in events(trace, "saved"))
    with engine(tiny_model, None, prefix_caching=False) as llm:
        reference, _ = generate(llm, prompt)
    assert tokens == reference
