"""Through the OpenAI server (`vllm-kvdisk serve`, default multi-process engine)."""

import glob
import os
import threading

import pytest
from engine import ALIGN, Server, disk_tokens, engine, events, generate, shared_prefix
from helpers import text

from vllm_kvdisk.core.saverules import Grid

pytestmark = pytest.mark.engine
GRID = Grid(ALIGN, 32, 128)
DS4_GRID = Grid(2048, 32, 128)


def test_four_turn_chat_with_a_restart_hits_the_tail(tiny_model, tmp_path):
    """Each turn restores up to where the conversation was: the block floor of what the
    server computed (previous prompt + reply) up to the first re-rendered token: what a
    device prefix cache would give, not the grid point below it; right after a restart,
    all of it from disk."""
    kv, trace, log = str(tmp_path / "kv"), str(tmp_path / "trace.txt"), str(tmp_path / "log")
    messages = [
        {"role": "system", "content": text(0, 900)},
        {"role": "user", "content": "Explain: " + text(900, 250)},
    ]
    ds4_grid = ("--trace", trace, "--kv-cache-boundary-align-tokens", "2048")
    server = Server(tiny_model, kv, log, *ds4_grid)
    computed: list[int] = []  # token ids the server computed last turn (prompt + reply)
    replies: list[tuple[list[int], list[int]]] = []  # (prompt ids, generated ids) per turn
    try:
        for turn in range(4):
            if turn == 2:  # restart between turns 2 and 3: the device cache is gone
                assert server.stop()["rc"] == 0
                server = Server(tiny_model, kv, log, *ds4_grid)
            before = disk_tokens(server)
            # A long first answer crosses grid positions: the evict save covers it.
            reply = server.chat(
                messages, max_tokens=300 if turn == 0 else 24, return_token_ids=True
            )
            prompt = reply["prompt_token_ids"]
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            ideal = min(shared_prefix(prompt, computed), len(prompt) - 1)
            if turn == 0:
                assert cached == 0
            else:
                tail = GRID.block_floor(ideal)  # what the device prefix cache would hold
                assert ideal >= 1000 and cached >= tail, (turn, cached, ideal)
                assert tail > DS4_GRID.floor(ideal)  # deeper than the grid alone would give
            if turn == 2:  # right after the restart: every cached token came from disk
                assert disk_tokens(server) - before == cached
            generated = reply["choices"][0]["token_ids"]
            replies.append((prompt, generated))
            computed = prompt + generated[:-1]  # the last sampled token has no KV yet
            messages += [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": text(1200 + 100 * turn, 80)},
            ]
    finally:
        server.stop()
    files = [p for p in glob.glob(os.path.join(kv, "*", "*.kv")) if "quarantine" not in p]
    assert files
    for path in files:
        head = open(path, "rb").read(4096)
        assert head[:3] == b"KVC" and text(0, 30).encode() in head  # hexdump shows the prompt
    assert {"cold", "evict"} <= {e.reason for e in events(trace, "saved")}
    with engine(tiny_model, None, prefix_caching=False) as llm:  # exact in every turn
        for prompt, generated in replies:
            assert generate(llm, prompt, max_tokens=len(generated))[0] == generated


def test_sessions_evicted_from_the_device_cache_resume_from_disk(tiny_model, tmp_path):
    kv, log = str(tmp_path / "kv"), str(tmp_path / "log")
    # 40 blocks x 128 tokens: room for about two of these conversations at a time.
    server = Server(
        tiny_model, kv, log, "--num-gpu-blocks-override", "40", "--max-model-len", "4096"
    )
    try:
        sessions = [
            [
                {"role": "system", "content": f"Session {i}. " + text(40 * i, 700)},
                {"role": "user", "content": text(800 + 40 * i, 150)},
            ]
            for i in range(6)
        ]
        for msgs in sessions:
            reply = server.chat(msgs)
            msgs += [reply["choices"][0]["message"], {"role": "user", "content": text(1500, 60)}]
        before = disk_tokens(server)
        for msgs in sessions[:3]:  # long evicted from the device cache by sessions 3..5
            prompt = server.tokenize(msgs)
            reply = server.chat(msgs)
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= GRID.floor(
                len(prompt) // 2
            )
        assert disk_tokens(server) - before >= 3 * 1000
    finally:
        server.stop()


def test_concurrent_sessions_sharing_a_system_prompt(tiny_model, tmp_path):
    kv, trace, log = str(tmp_path / "kv"), str(tmp_path / "trace.txt"), str(tmp_path / "log")
    server = Server(tiny_model, kv, log, "--trace", trace)
    system = {"role": "system", "content": text(0, 800)}
    convs = {
        i: [system, {"role": "user", "content": f"Task {i}: " + text(1000 + 97 * i, 300)}]
        for i in range(8)
    }
    errors: list[BaseException] = []
    cached: dict[int, int] = {}

    def turn(i: int) -> None:
        try:
            reply = server.chat(convs[i])
            cached[i] = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            convs[i] += [reply["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def all_at_once() -> None:
        threads = [threading.Thread(target=turn, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)

    try:
        all_at_once()
        server.reset_device_cache()
        before = disk_tokens(server)
        all_at_once()
        from_disk = disk_tokens(server) - before
    finally:
        server.stop()
    assert not errors, errors
    assert all(cached[i] >= 1024 for i in range(8)), cached
    # The first sessions restored the shared system prompt from disk; the ones admitted
    # after them may find those blocks already back in the device cache.
    assert from_disk >= 1024
    saved = [e.sha1 for e in events(trace, "saved")]
    assert len(saved) == len(set(saved)), "a checkpoint was written twice"
    # The shared system prompt's checkpoint is one file that the sessions' deltas extend.
    roots = [e for e in events(trace, "saved") if e.reason == "cold"]
    assert len(roots) < 8 * 2
