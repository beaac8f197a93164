"""Tensor parallel 2, end to end: `vllm-kvdisk serve` with two ranks (one core each).

Each rank writes and reads its own namespace (its half of the KV heads); the scheduler
plans from rank 0's index. One module-scoped run (a server, then a restart on the same
directory) is shared by the tests that read it, so the file starts four TP 2 servers in
all (~45 s each here): the run's two, a plain vLLM reference and one with a small budget.
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from engine import OUTCOME_WAIT_S, Server, random_prompt, shared_prefix
from helpers import text

from vllm_kvdisk.core.saverules import Grid
from vllm_kvdisk.ops.trace import TraceEvent, read
from vllm_kvdisk.storage.fileread import read_meta, read_tokens
from vllm_kvdisk.testing import harness

pytestmark = pytest.mark.engine

GRID = Grid(256, 32, 128)  # tests/engine.py's grid (block 128)
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (see VLLM_NOTES)
TP_ARGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
OUTCOMES = ("loaded", "load_failed")  # each rank traces one of these per load job


@dataclass(slots=True)
class Turn:
    messages: list[dict]
    prompt: list[int]
    generated: list[int]
    cached: int
    ideal: int  # what vLLM's own warm prefix cache would keep of this prompt


@dataclass(slots=True)
class Conversation:
    messages: list[dict]
    turns: list[Turn] = field(default_factory=list)

    def turn(self, server: Server, follow_up: str, max_tokens: int = 24) -> Turn:
        """Send the conversation, record what came back, append the reply and a follow-up."""
        reply = server.chat(self.messages, max_tokens=max_tokens, return_token_ids=True)
        prompt = reply["prompt_token_ids"]
        computed: list[int] = []  # what the server computed last turn (its KV)
        if self.turns:
            computed = self.turns[-1].prompt + self.turns[-1].generated[:-1]
        ideal = GRID.block_floor(min(shared_prefix(prompt, computed), len(prompt) - 1))
        turn = Turn(
            [dict(m) for m in self.messages],
            prompt,
            reply["choices"][0]["token_ids"],
            reply["usage"]["prompt_tokens_details"]["cached_tokens"],
            ideal,
        )
        self.turns.append(turn)
        self.messages += [
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": follow_up},
        ]
        return turn


def wait_for(
    trace: str,
    start: int,
    ready: Callable[[list[TraceEvent]], bool],
    timeout: float = OUTCOME_WAIT_S,
) -> list[TraceEvent]:
    """Trace events from index ``start`` on, once ``ready(events)`` holds (the workers'
    I/O threads write them, shortly after the request returns)."""
    deadline = time.monotonic() + timeout
    while True:
        found = read(trace)[start:]
        if ready(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def count(evs: list[TraceEvent], *kinds: str, sha1: str | None = None) -> int:
    return sum(e.kind in kinds and (sha1 is None or e.sha1 == sha1) for e in evs)


def rank_dirs(kv: str) -> dict[int, str]:
    """TP rank -> its namespace directory (what each namespace.json says)."""
    out: dict[int, str] = {}
    for path in glob.glob(os.path.join(kv, "*", "namespace.json")):
        with open(path) as fh:
            info = json.load(fh)
        assert info["tp_size"] == 2
        out[info["tp_rank"]] = os.path.dirname(path)
    assert sorted(out) == [0, 1], out
    return out


def kv_names(ns_dir: str) -> set[str]:
    return {n[:-3] for n in os.listdir(ns_dir) if n.endswith(".kv")}


def header_hits(path: str) -> int:
    with open(path, "rb") as fh:
        return read_meta(fh.fileno(), os.fstat(fh.fileno()).st_size).header.hits


def checkpoint_of(ns_dir: str, prompt: list[int], tokens: int) -> str:
    """The sha1 of the file in ``ns_dir`` that holds exactly ``prompt[:tokens]``."""
    for sha1 in sorted(kv_names(ns_dir)):
        with open(os.path.join(ns_dir, sha1 + ".kv"), "rb") as fh:
            meta = read_meta(fh.fileno(), os.fstat(fh.fileno()).st_size)
            if meta.header.tokens == tokens:
                ids = memoryview(read_tokens(fh.fileno(), meta)).cast("I").tolist()
                if ids == prompt[:tokens]:
                    return sha1
    raise AssertionError(f"no checkpoint of the first {tokens} prompt tokens in {ns_dir}")


def disk_tokens(server: Server) -> float:
    return server.metric("vllm:prompt_tokens_cached_by_source_total", source="disk")


@dataclass(slots=True)
class Run:
    """The shared run: conversations on a TP 2 server, then on a second one started on
    the same directory."""

    kv: str
    main: Conversation
    side: Conversation
    restart: Turn  # main's first turn after the restart
    restart_from_disk: float  # tokens vLLM counted as cached from disk for it
    restart_events: list[TraceEvent]  # trace events of that turn
    deleted: str  # checkpoint whose rank 1 file was deleted before side's next turn
    side_events: list[TraceEvent]  # trace events of side's turn after the deletion


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("tp2")
    kv, trace, log = str(tmp / "kv"), str(tmp / "trace.txt"), str(tmp / "server.log")
    main = Conversation(
        [
            {"role": "system", "content": text(0, 700)},
            {"role": "user", "content": "Explain: " + text(700, 200)},
        ]
    )
    side = Conversation(
        [
            {"role": "system", "content": "Other. " + text(1000, 600)},
            {"role": "user", "content": text(1600, 150)},
        ]
    )
    server = Server(tiny_model, kv, log, "--trace", trace, *TP_ARGS, env=TP_ENV)
    try:
        main.turn(server, text(1200, 60), max_tokens=200)  # a long answer crosses the grid
        main.turn(server, text(1300, 60))
        side.turn(server, text(1400, 60))
        assert server.stop()["rc"] == 0  # SIGTERM: saves in flight are written first
        server = Server(tiny_model, kv, log, "--trace", trace, *TP_ARGS, env=TP_ENV)
        mark, before = len(read(trace)), disk_tokens(server)
        restart = main.turn(server, text(1500, 60))
        restart_from_disk = disk_tokens(server) - before
        restart_events = wait_for(trace, mark, lambda evs: count(evs, *OUTCOMES) >= 2)
        # Rank 1 loses its file of side's prompt (the tail checkpoint at its block floor),
        # which side's next turn restores through.
        rank1 = rank_dirs(kv)[1]
        side_prompt = side.turns[0].prompt
        deleted = checkpoint_of(rank1, side_prompt, GRID.block_floor(len(side_prompt)))
        os.unlink(os.path.join(rank1, deleted + ".kv"))
        mark = len(read(trace))
        side.turn(server, text(1700, 60))
        side_events = wait_for(trace, mark, lambda evs: count(evs, *OUTCOMES) >= 2)
        main.turn(server, text(1800, 60))  # the device cache and the disk together
    finally:
        server.stop()
    return Run(kv, main, side, restart, restart_from_disk, restart_events, deleted, side_events)


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory, run: Run) -> dict[tuple[str, int], list[int]]:
    """Greedy tokens of every turn of the run from a TP 2 vLLM without the connector and
    without a prefix cache: (conversation, turn) -> generated ids."""
    log = str(tmp_path_factory.mktemp("tp2-ref") / "server.log")
    port = harness.free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
        **TP_ENV,
    }
    cmd = harness.vllm_command(
        tiny_model,
        port,
        "--dtype",
        "float32",
        "--max-model-len",
        "8192",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        *TP_ARGS,
    )
    server = harness.Server(cmd, log, port, env=env, model=tiny_model, timeout_s=240)
    out: dict[tuple[str, int], list[int]] = {}
    try:
        for name, conv in (("main", run.main), ("side", run.side)):
            for i, turn in enumerate(conv.turns):
                reply = server.chat(
                    turn.messages, max_tokens=len(turn.generated), return_token_ids=True
                )
                assert reply["prompt_token_ids"] == turn.prompt
                out[(name, i)] = reply["choices"][0]["token_ids"]
    finally:
        server.stop()
    return out


def test_first_turn_after_a_restart_restores_what_a_warm_prefix_cache_keeps(run: Run):
    turn = run.restart
    print(
        f"TP 2, first turn after the restart: {turn.cached} cached of {turn.ideal} that a "
        f"warm prefix cache keeps ({turn.cached / turn.ideal:.2f})"
    )
    assert turn.ideal >= 1000
    assert turn.cached >= turn.ideal, (turn.cached, turn.ideal)
    assert run.restart_from_disk == turn.cached  # the device cache was empty: all from disk
    assert count(run.restart_events, "load_failed") == 0, [e.line for e in run.restart_events]


def test_both_ranks_restore_from_their_own_files(run: Run):
    """Each rank traces its own outcome of a load job and counts a hit in its own file's
    header: after the restart both ranks loaded, from rank 0's and rank 1's namespaces."""
    (sha1,) = {e.sha1 for e in run.restart_events if e.kind == "loaded"}
    assert count(run.restart_events, "loaded", sha1=sha1) == 2
    for rank, ns_dir in sorted(rank_dirs(run.kv).items()):
        assert header_hits(os.path.join(ns_dir, sha1 + ".kv")) >= 1, rank


def test_greedy_output_equals_a_tp2_server_without_the_connector(run: Run, reference):
    for name, conv in (("main", run.main), ("side", run.side)):
        for i, turn in enumerate(conv.turns):
            assert turn.generated == reference[(name, i)], (name, i)
    assert len(run.main.turns) == 4 and sum(t.cached for t in run.main.turns[1:]) > 0


def test_a_rank_missing_its_file_recomputes_and_answers_exactly(run: Run, reference):
    """Rank 1's file of a checkpoint is gone: rank 1 reports its blocks from that file on
    as load errors, vLLM recomputes them, and the answer is still exact."""
    failed = [e for e in run.side_events if e.kind == "load_failed"]
    assert [e.sha1 for e in failed] == [run.deleted], [e.line for e in run.side_events]
    assert "recomputed" in failed[0].line
    assert count(run.side_events, "loaded") == 1  # rank 0 restored its own files
    assert run.side.turns[1].generated == reference[("side", 1)]
    assert not os.path.exists(os.path.join(rank_dirs(run.kv)[1], run.deleted + ".kv"))


def test_under_a_small_budget_both_ranks_lose_a_checkpoint_together(tiny_model, tmp_path):
    """One checkpoint per prompt (no grid point below 8192 tokens: only the tail at the
    prompt's block floor, 640 tokens, ~1.25 MiB per rank), a budget for two of them."""
    kv, trace, log = str(tmp_path / "kv"), str(tmp_path / "trace.txt"), str(tmp_path / "log")
    budget_mb = 6
    server = Server(
        tiny_model,
        kv,
        log,
        "--trace",
        trace,
        "--kv-cache-boundary-align-tokens",
        "8192",
        "--kv-disk-space-mb",
        str(budget_mb),
        *TP_ARGS,
        env=TP_ENV,
    )
    prompts = [random_prompt(700, seed=40 + i) for i in range(6)]
    try:
        answers = []
        outcomes = ("saved", "save_skipped", "save_failed")
        for i, prompt in enumerate(prompts):
            body = {"model": tiny_model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
            answers.append(server.post("/v1/completions", body)["choices"][0]["text"])
            # One save per prompt, on each rank: wait until both have an outcome.
            assert count(
                wait_for(trace, 0, lambda evs, n=2 * (i + 1): count(evs, *outcomes) >= n), *outcomes
            ) >= 2 * (i + 1)
        dirs = rank_dirs(kv)
        on_disk = {rank: kv_names(d) for rank, d in dirs.items()}
        size = sum(os.path.getsize(p) for d in dirs.values() for p in glob.glob(d + "/*.kv"))
        evs = read(trace)
        server.reset_device_cache()
        body = {"model": tiny_model, "prompt": prompts[0], "max_tokens": 2, "temperature": 0}
        again = server.post("/v1/completions", body)["choices"][0]["text"]
        after = read(trace)[len(evs) :]
    finally:
        server.stop()
    assert count(evs, "save_skipped", "save_failed") == 0
    evicted = [e.sha1 for e in evs if e.kind == "evicted"]
    assert evicted, "the budget never made room"
    assert on_disk[0] == on_disk[1] and on_disk[0]
    for sha1 in set(evicted):
        assert evicted.count(sha1) == 2, sha1  # from rank 0's and rank 1's namespace
        assert sha1 not in on_disk[0]
    assert size <= budget_mb << 20
    # The first prompt's checkpoint went from both ranks: a miss, never a failed load.
    assert count(after, *OUTCOMES) == 0 and again == answers[0]


def test_an_empty_disk_restores_both_ranks_from_the_object_store(
    run: Run, reference, seaweed, tiny_model, tmp_path, monkeypatch
):
    """A TP 2 replica on an empty disk, with the run's files in a bucket (each uploaded
    with the uploader's own call): the fetch brings rank 1's files beside rank 0's, both
    ranks load, and the answer is the run's."""
    import uuid

    from vllm_kvdisk.core.objects import ObjectUrl
    from vllm_kvdisk.storage.objectstore import Bucket

    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    url = f"s3://{seaweed.bucket}/tp2-{uuid.uuid4().hex[:8]}"
    bucket = Bucket(ObjectUrl.parse(url), timeout_s=60.0)
    for ns_dir in rank_dirs(run.kv).values():
        for sha1 in kv_names(ns_dir):
            with open(os.path.join(ns_dir, sha1 + ".kv"), "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                bucket.put_file(os.path.basename(ns_dir), sha1, fh.fileno(), size)
    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    server = Server(
        tiny_model,
        kv,
        str(tmp_path / "server.log"),
        "--trace",
        trace,
        "--kv-object-url",
        url,
        "--kv-object-deadline-s",  # the store's speed is never the verdict (see D in
        str(int(OUTCOME_WAIT_S)),  # test_engine_objects for the deadline itself)
        *TP_ARGS,
        env={**TP_ENV, **seaweed.env()},
    )
    try:
        turn = run.restart
        reply = server.chat(turn.messages, max_tokens=len(turn.generated), return_token_ids=True)
        evs = wait_for(trace, 0, lambda e: count(e, *OUTCOMES) >= 2)
    finally:
        server.stop()
    assert reply["prompt_token_ids"] == turn.prompt
    assert reply["choices"][0]["token_ids"] == turn.generated == reference[("main", 2)]
    # At least the run's hit: the bucket also holds what the run saved after that turn.
    assert (
        turn.cached <= reply["usage"]["prompt_tokens_details"]["cached_tokens"] < len(turn.prompt)
    )
    assert count(evs, "load_failed") == 0 and count(evs, "loaded") == 2, [e.line for e in evs]
    assert all(kv_names(d) for d in rank_dirs(kv).values())  # both ranks' files fetched
