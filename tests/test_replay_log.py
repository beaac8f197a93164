"""The tool-call log on disk: durable at once, shared, bounded, and safe to read."""

import multiprocessing as mp
import os

from vllm_kvdisk.replay.log import (
    DIRNAME,
    MAGIC,
    Scan,
    ToolCall,
    ToolLog,
    encode_record,
    newest_calls,
    scan_records,
)


def call(i: int) -> ToolCall:
    return ToolCall(
        (f"chatcmpl-tool-{i}",), f'<tool_call>{{"n": {i}}}</tool_call>', (1, 2, i), "t", bytes(32)
    )


def test_records_round_trip_and_damage_is_skipped_not_fatal():
    raw = b"".join(encode_record("tok", call(i)) for i in range(3))
    found = scan_records(raw, "tok")
    assert found.calls == [call(0), call(1), call(2)] and found.used == len(raw) and not found.bad
    assert scan_records(raw, "another tokenizer") == Scan([], len(raw), 0, 3)
    broken = bytearray(raw)
    broken[len(encode_record("tok", call(0))) + 20] ^= 0xFF  # inside record 1's body
    found = scan_records(bytes(broken), "tok")
    assert [c.ids for c in found.calls] == [call(0).ids, call(2).ids] and found.bad == 1
    found = scan_records(raw[:-5], "tok")  # a write in progress: left for later
    assert len(found.calls) == 2 and found.used == len(raw) - len(encode_record("tok", call(2)))
    garbage = os.urandom(5000) + raw
    assert scan_records(garbage, "tok").calls[-3:] == [call(0), call(1), call(2)]
    huge = MAGIC + (0xFFFFFFFF).to_bytes(4, "little") + bytes(8)  # claims 4 GiB: not allocated
    assert scan_records(huge, "tok").calls == []


def test_a_call_is_on_disk_before_append_returns_and_other_processes_read_it(tmp_path):
    writer = ToolLog(str(tmp_path), "tok", max_ids=100)
    reader = ToolLog(str(tmp_path), "tok", max_ids=100)
    assert writer.append(call(1))
    assert reader.poll() == [call(1)]  # no fsync, no close needed: a kill -9 loses nothing
    assert reader.poll() == []  # tailing: only what is new
    writer.append(call(2))
    assert reader.poll() == [call(2)]
    other_model = ToolLog(str(tmp_path), "another tokenizer", max_ids=100)
    assert other_model.poll() == []  # another model's records never replay here


def test_the_log_stays_bounded_and_dead_writers_are_folded(tmp_path):
    log = ToolLog(str(tmp_path), "tok", max_ids=5)
    kept: list[ToolCall] = []
    for i in range(1100):
        kept.append(call(i))
        log.append(call(i), lambda: newest_calls(kept, 5))
    size = sum(os.path.getsize(tmp_path / DIRNAME / n) for n in os.listdir(tmp_path / DIRNAME))
    assert size < 1100 * len(encode_record("tok", call(1000))) / 2
    log.close()  # its writer is gone now (the lock is released with the descriptor)
    for name in os.listdir(tmp_path / DIRNAME):
        os.utime(tmp_path / DIRNAME / name, (0, 0))
    fresh = ToolLog(str(tmp_path), "tok", max_ids=5)
    calls = fresh.poll()
    assert calls[-1] == call(1099)
    assert fresh.fold_dead(newest_calls(calls, 5)) == 1
    assert len(os.listdir(tmp_path / DIRNAME)) == 1
    again = ToolLog(str(tmp_path), "tok", max_ids=5)
    assert [c.ids for c in again.poll()] == [call(i).ids for i in range(1095, 1100)]


def test_a_live_writers_log_is_never_folded(tmp_path):
    live = ToolLog(str(tmp_path), "tok", max_ids=5)
    live.append(call(1))
    for name in os.listdir(tmp_path / DIRNAME):
        os.utime(tmp_path / DIRNAME / name, (0, 0))
    other = ToolLog(str(tmp_path), "tok", max_ids=5)
    assert other.fold_dead(newest_calls(other.poll(), 5)) == 0
    live.append(call(2))
    assert other.poll() == [call(2)]


def _append_and_die(root):
    log = ToolLog(root, "tok", max_ids=10)
    if log.append(call(7)):
        os._exit(9)  # as kill -9 would: no close, no flush, no fsync
    os._exit(1)


def test_a_call_appended_just_before_a_kill_survives(tmp_path):
    proc = mp.get_context("spawn").Process(target=_append_and_die, args=(str(tmp_path),))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 9
    assert ToolLog(str(tmp_path), "tok", max_ids=10).poll() == [call(7)]


def test_a_symlinked_or_unwritable_log_directory_is_a_warning_not_a_crash(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / DIRNAME)
    log = ToolLog(str(tmp_path), "tok", max_ids=10)
    assert not log.available and not log.append(call(1)) and log.poll() == []
    assert os.listdir(tmp_path / "elsewhere") == []


def test_folding_dead_logs_never_loses_another_models_calls(tmp_path):
    """Two models share a cache directory. A restarted server of model A folds the logs
    whose writer is dead, and must leave model B's calls for B's next server."""
    for scope, i in (("model-a", 1), ("model-b", 2)):
        dead = ToolLog(str(tmp_path), scope, max_ids=10)
        assert dead.append(call(i))
        dead.close()
    for name in os.listdir(tmp_path / DIRNAME):
        os.utime(tmp_path / DIRNAME / name, (0, 0))  # writers gone long ago
    a = ToolLog(str(tmp_path), "model-a", max_ids=10)
    calls = a.poll()
    assert calls == [call(1)]
    a.fold_dead(newest_calls(calls, 10))
    b = ToolLog(str(tmp_path), "model-b", max_ids=10)
    assert b.poll() == [call(2)]
    b.fold_dead(newest_calls(b.poll(), 10))
    assert ToolLog(str(tmp_path), "model-a", max_ids=10).poll() == [call(1)]


def test_a_dead_log_is_folded_only_once_read_and_a_torn_record_does_not_pin_it(tmp_path):
    dead = ToolLog(str(tmp_path), "tok", max_ids=10)
    dead.append(call(1))
    dead.close()
    (name,) = os.listdir(tmp_path / DIRNAME)
    with open(tmp_path / DIRNAME / name, "ab") as fh:
        fh.write(encode_record("tok", call(2))[:-3])  # killed mid-write
    os.utime(tmp_path / DIRNAME / name, (0, 0))
    fresh = ToolLog(str(tmp_path), "tok", max_ids=10)
    assert fresh.fold_dead([]) == 0  # never read: it may hold calls nobody has
    calls = fresh.poll()
    assert calls == [call(1)]
    assert fresh.fold_dead(newest_calls(calls, 10)) == 1
    assert ToolLog(str(tmp_path), "tok", max_ids=10).poll() == [call(1)]


def test_reading_a_large_log_takes_memory_bounded_by_a_window_not_by_the_log(tmp_path):
    """A log may hold ~100k records before compaction. Reading it must be linear: the old
    reader grew one ``bytes`` by 1 MiB chunks (each step copied everything read so far),
    so its peak was twice the log and its time quadratic. Allocated bytes, not time, are
    the measure here."""
    import tracemalloc

    os.makedirs(tmp_path / DIRNAME)
    big = ToolCall(("other-model-call",), "x" * (64 << 10), (1, 2, 3), "t", bytes(32))
    record = encode_record("another model", big)
    count = (24 << 20) // len(record)
    with open(tmp_path / DIRNAME / "host-1-dead.ktl", "wb") as fh:
        for _ in range(count):
            fh.write(record)
        fh.write(encode_record("tok", call(5)))
    size = os.path.getsize(tmp_path / DIRNAME / "host-1-dead.ktl")
    reader = ToolLog(str(tmp_path), "tok", max_ids=10)
    tracemalloc.start()
    try:
        calls = reader.poll()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert calls == [call(5)]
    assert peak < size // 2, f"peak {peak >> 20} MiB reading a {size >> 20} MiB log"


def test_records_larger_than_the_read_window_and_across_its_edges_are_read(tmp_path):
    os.makedirs(tmp_path / DIRNAME)
    calls = [
        ToolCall((f"id-{i}",), "y" * n, tuple(range(i % 7)), "t", bytes(32))
        for i, n in enumerate([10, (1 << 20) - 3, 70_000, 1 << 20, 5, 300_000] * 3)
    ]
    calls.append(ToolCall(("many-tokens",), "z", tuple(range(1 << 18)), "t", bytes(32)))
    with open(tmp_path / DIRNAME / "host-2-dead.ktl", "wb") as fh:
        for c in calls:
            fh.write(encode_record("tok", c))
        fh.write(encode_record("tok", call(9))[:30])  # torn: left for later
    assert ToolLog(str(tmp_path), "tok", max_ids=100).poll() == calls


def test_a_fifo_or_a_directory_named_like_a_log_never_blocks_the_reader(tmp_path):
    """A FIFO opened for reading blocks until a writer comes: the reader (the API server's
    start-up, its polls) must refuse it, never wait on it."""
    import threading

    writer = ToolLog(str(tmp_path), "tok", max_ids=10)
    writer.append(call(3))
    os.mkfifo(tmp_path / DIRNAME / "a-fifo.ktl")
    os.mkdir(tmp_path / DIRNAME / "a-dir.ktl")
    reader = ToolLog(str(tmp_path), "tok", max_ids=10)
    found: list = []
    # Called by name, as a listing that raced with a rename would: no listing filter helps.
    probe = threading.Thread(
        target=lambda: found.append(
            (
                reader._scan_file("a-fifo.ktl", 0),
                reader._scan_file("a-dir.ktl", 0),
                reader.poll(),
                reader.fold_dead([]),
            )
        ),
        daemon=True,
    )
    probe.start()
    probe.join(120)  # only a reader stuck for good leaves this join without a result
    assert found == [(None, None, [call(3)], 0)]
