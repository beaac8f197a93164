"""A disk restore gives exactly what the engine's own prefix cache (or no cache) gives, and a
server with kvdisk computes exactly what plain `vllm serve` computes."""

import time

import numpy as np
import pytest
from engine import OUTCOME_WAIT_S, Server, disk_tokens, engine, events, generate, random_prompt
from helpers import text

from vllm_kvdisk.connector.transfer import PageMover
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.testing import harness

pytestmark = pytest.mark.engine
# GPU users serve in bf16, which keeps differences fp32 rounds away: these run in both.
DTYPES = pytest.mark.parametrize("dtype", ["float32", "bfloat16"])


@DTYPES
def test_greedy_tokens_identical_no_cache_gpu_hit_disk_hit_and_after_restart(
    tiny_model, tmp_path, dtype
):
    kv = str(tmp_path / "kv")
    trace = str(tmp_path / "trace.txt")
    prompt = random_prompt(1500, seed=1)
    with engine(tiny_model, None, prefix_caching=False, llm_args={"dtype": dtype}) as llm:
        reference, cached = generate(llm, prompt, max_tokens=24)
        assert cached == 0
    with engine(tiny_model, kv, trace=trace, llm_args={"dtype": dtype}) as llm:
        cold, cached = generate(llm, prompt, max_tokens=24)
        assert cached == 0
        gpu, gpu_cached = generate(llm, prompt, max_tokens=24)
        assert gpu_cached >= 1280  # the engine's own prefix cache
        llm.reset_prefix_cache()  # evict everything from the device cache
        disk, disk_cached = generate(llm, prompt, max_tokens=24)
    # Grid 256/32 on 128-token blocks: the deepest checkpoint below 1500 is 1408.
    assert disk_cached == 1408
    assert len(events(trace, "loaded")) >= 1
    with engine(
        tiny_model, kv, trace=trace, llm_args={"dtype": dtype}
    ) as llm:  # a restarted server: disk only
        restarted, restart_cached = generate(llm, prompt, max_tokens=24)
    assert restart_cached == 1408
    assert reference == cold == gpu == disk == restarted
    assert len(set(reference)) > 4  # the model is not stuck on one token
    assert payload_versions(kv) == {4}  # the tests' setting compresses the pages


@DTYPES
@pytest.mark.parametrize("compression", ["zstd", "off"])
def test_pages_read_back_are_byte_identical_to_pages_written(
    tiny_model, tmp_path, monkeypatch, dtype, compression
):
    """Compressed pages (zstd) and raw ones (off) both restore the bytes the engine's
    blocks held."""
    import vllm_kvdisk.connector.restore as restore_mod

    written: dict[int, np.ndarray] = {}  # block index in the request -> page bytes, layer 0
    loaded: list[tuple[int, bytes]] = []  # (layer, bytes the restore read into the blocks)
    targets: list[tuple[object, list[int]]] = []  # (mover, block ids) of each file restored
    gather, block_runs = PageMover.gather, PageMover.block_runs
    read_layers_into = restore_mod.read_layers_into

    def spy_gather(self, block_ids, out, after=None):
        gather(self, block_ids, out, after)
        rows = out[0].reshape(len(block_ids), -1)
        for i, _ in enumerate(block_ids):
            written[len(written)] = rows[i].copy()

    def spy_block_runs(self, block_ids):
        targets.append((self, list(block_ids)))
        return block_runs(self, block_ids)

    def spy_read(fd, meta, first, outs):  # every layer of a fully used file in one call
        read_layers_into(fd, meta, first, outs)
        for i, out in enumerate(outs):
            loaded.append((first + i, b"".join(bytes(v) for v in out)))

    monkeypatch.setattr(PageMover, "gather", spy_gather)
    monkeypatch.setattr(PageMover, "block_runs", spy_block_runs)
    monkeypatch.setattr(restore_mod, "read_layers_into", spy_read)
    prompt = random_prompt(1000, seed=2)  # one checkpoint: 896 tokens = 7 blocks
    kv = str(tmp_path / "kv")
    with engine(tiny_model, kv, llm_args={"dtype": dtype}, kv_disk_compression=compression) as llm:
        first, _ = generate(llm, prompt)
        deadline = (
            time.monotonic() + OUTCOME_WAIT_S
        )  # the copy runs after the step, on its own thread
        while len(written) < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(written) == 7
        llm.reset_prefix_cache()
        again, cached = generate(llm, prompt)
        assert cached == 896 and first == again
        layer0 = [data for layer, data in loaded if layer == 0]
        assert len(layer0) == 1
        assert len(targets) == 1  # one file restored
        mover, ids = targets[0]
        assert len(ids) == 7
        out = [
            np.empty(len(ids) * mover.page_bytes, dtype=np.uint8)
            for _ in range(mover.layout.num_layers)
        ]
        gather(mover, ids, out)  # what the engine's blocks hold after the restore
        in_cache = out[0].reshape(len(ids), -1)
        read = np.frombuffer(layer0[0], dtype=np.uint8).reshape(len(ids), -1)
        for i in range(7):
            assert read[i].tobytes() == written[i].tobytes() == in_cache[i].tobytes()
    assert sorted(layer for layer, _ in loaded) == [0, 1, 2, 3]  # every layer was restored
    assert payload_versions(kv) == ({4} if compression == "zstd" else {2})


def payload_versions(kv: str) -> set[int]:
    """The payload versions of the files under ``kv`` (4: compressed pages)."""
    store = Store(kv, space_bytes=1 << 40, readonly=True)
    store.scan()
    versions = set()
    for e in store.index.entries():
        with store.open(e.ns, e.sha1) as (_, meta, _):
            versions.add(meta.payload.version)
    return versions


@DTYPES
def test_disk_hit_extends_a_gpu_hit(tiny_model, tmp_path, dtype):
    """A longer prompt restores only the blocks the device cache lacks, then the rest; and
    its checkpoints are deltas on the first prompt's, grid points on tails alike, so no
    block is on disk twice."""
    kv = str(tmp_path / "kv")
    base = random_prompt(1500, seed=3)
    with engine(tiny_model, kv, llm_args={"dtype": dtype}) as llm:
        generate(llm, base[:1100])  # grid point 896, tail 1024
        generate(llm, base)  # grid point and tail 1408, a delta on the tail at 1024
        llm.reset_prefix_cache()
        generate(llm, base[:500])  # device cache now holds 384 tokens of the prefix
        tokens, cached = generate(llm, base)
        assert cached == 1408
    with engine(tiny_model, None, prefix_caching=False, llm_args={"dtype": dtype}) as llm:
        reference, _ = generate(llm, base)
    assert tokens == reference
    store = Store(kv, space_bytes=1 << 40, readonly=True)
    store.scan()
    deepest = max(store.index.entries(), key=lambda e: e.tokens)
    chain = store.index.chain(deepest.ns, deepest.sha1)
    assert [(e.parent_tokens, e.tokens) for e in chain] == [
        (0, 896),
        (896, 1024),
        (1024, 1408),
    ]
    # Every other file holds a branch (a reply the engine generated), never blocks of this
    # prompt again: the tail at 1024 is in the chain, not beside it as a leaf.
    for e in store.index.entries():
        if e not in chain:
            ids = store.read_ids(e, 0, e.tokens)
            assert ids is not None and list(ids) != base[: e.tokens]


@DTYPES
def test_a_sibling_session_restores_past_the_grid_point_inside_the_first_ones_file(
    tiny_model, tmp_path, dtype
):
    """ds4's grid (2048/32): session A's 3200-token prompt leaves checkpoints at 1920 (the
    grid) and 3200 (its untrimmed tail). Session B shares A's first 3000 tokens: it restores 2944,
    the last whole block before it leaves A's tail file, not just the grid point 1920."""
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    a = random_prompt(3200, seed=9)
    b = a[:3000] + random_prompt(400, seed=10)
    with engine(tiny_model, None, prefix_caching=False, llm_args={"dtype": dtype}) as llm:
        reference, _ = generate(llm, b)
    with engine(
        tiny_model, kv, trace=trace, kv_cache_boundary_align_tokens=2048, llm_args={"dtype": dtype}
    ) as llm:
        generate(llm, a)
        llm.reset_prefix_cache()
        tokens, cached = generate(llm, b)
    assert cached == 2944 > 1920 and tokens == reference
    hit = [e for e in events(trace, "hit")][-1]
    assert "used up to token 2944 of 3200" in hit.detail
    # B's own checkpoint branches off inside A's file: only B's new blocks were written.
    store = Store(kv, space_bytes=1 << 40, readonly=True)
    store.scan()
    b_tail = max(store.index.entries(), key=lambda e: e.tokens)
    assert (b_tail.parent_tokens, b_tail.tokens) == (2944, 3328)


def converse(start, restart_before: int | None = None, turns: int = 3) -> list[tuple]:
    """A live chat, greedy: each reply goes into the next turn's prompt, so two servers see
    the same history only while they agree. (prompt ids, reply ids, cached tokens) per
    turn, and the tokens restored from disk on each turn (None for a plain server)."""
    messages = [
        {"role": "system", "content": text(0, 900)},
        {"role": "user", "content": "Explain: " + text(900, 250)},
    ]
    server, out = start(), []
    try:
        for turn in range(turns):
            if turn == restart_before:
                assert server.stop()["rc"] == 0
                server = start()
            before = disk_tokens(server) if isinstance(server, Server) else None
            reply = server.chat(messages, max_tokens=32, return_token_ids=True)
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            loaded = None if before is None else disk_tokens(server) - before
            ids = reply["choices"][0]["token_ids"]
            out.append((reply["prompt_token_ids"], ids, cached, loaded))
            messages += [
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                {"role": "user", "content": text(1200 + 100 * turn, 80)},
            ]
    finally:
        server.stop()
    return out


def test_bf16_server_replies_equal_plain_vllms_at_the_same_cache_positions(tiny_model, tmp_path):
    """The same chat through two plain `vllm serve` (prefix caching, never restarted: the
    control) and `vllm-kvdisk serve` (restarted before turn 3, which then restores from disk
    what the plain server's warm cache holds): same prompt ids, same cached tokens, same
    replies on every turn. Before the fix kvdisk's reply differed from turn 1 on: configuring
    a KV connector made vLLM's CPU backend keep one more core out of the worker's OpenMP
    threads, and the thread count alone changes bf16 results."""
    args = ("--dtype", "bfloat16", "--max-model-len", "8192", "--enforce-eager")

    def plain(name: str):
        def start():
            port = harness.free_port()
            cmd = harness.vllm_command(tiny_model, port, *args, "--enable-prompt-tokens-details")
            log = str(tmp_path / f"{name}.log")
            return harness.Server(cmd, log, port, model=tiny_model, timeout_s=240)

        return start

    def kvdisk():
        return Server(
            tiny_model, str(tmp_path / "kv"), str(tmp_path / "kvdisk.log"), dtype="bfloat16"
        )

    first, control = converse(plain("plain-1")), converse(plain("plain-2"))
    assert [t[:3] for t in control] == [t[:3] for t in first]  # vLLM agrees with itself
    ours = converse(kvdisk, restart_before=2)
    for turn, ((prompt, reply, cached, _), (p, r, c, loaded)) in enumerate(zip(first, ours)):
        assert p == prompt and c == cached, turn  # same history, same cache positions
        assert r == reply, (turn, reply, r)
        assert len(set(reply)) > 4
    assert [t[2] for t in first][0] == 0 and all(t[2] >= 1024 for t in first[1:])
    assert [t[3] for t in ours][:2] == [0, 0]  # no disk hit before the restart
    assert ours[2][3] == ours[2][2]  # after it, every cached token came from disk
