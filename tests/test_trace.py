"""The trace format: every typed event parses back; the file is bounded and rotatable."""

import os

from vllm_kvdisk.ops.trace import Trace, parse, read

SHA = "0123456789abcdef0123456789abcdef01234567"


def test_every_event_parses_back(tmp_path):
    path = str(tmp_path / "t.log")
    t = Trace(path)
    t.miss(None, "below min tokens")
    t.miss(SHA, "prefix mismatch at byte 10 (token 3) of checkpoint " + SHA)
    t.hit(SHA, 640, 2, "0 already in the GPU cache")
    t.loaded(SHA, 640, 2, 0.012)
    t.device_hit(SHA, 3456, 1920)
    t.probe(SHA, 0.5, 0.1)
    t.saved("cold", SHA, 1920, 7880704, 0.042)
    t.save_failed("evict", SHA, "No space left on device")
    t.save_failed("cold", SHA, "only 0 are evictable", "no_space")
    t.evicted(SHA, 640, 2629632)
    t.quarantined(SHA, "checksum mismatch in layer 1")
    t.dropped(SHA, 512, 4096, "its chain's file " + SHA + " was quarantined")
    t.load_failed(SHA, "checksum mismatch in layer 1", 5)
    t.replay("1 from memory, 0 from disk, 0 missing, 0 changed")
    t.close()
    events = read(path)
    assert [e.kind for e in events] == [
        "miss",
        "miss",
        "hit",
        "loaded",
        "device_hit",
        "probe",
        "saved",
        "save_failed",
        "save_skipped",
        "evicted",
        "quarantined",
        "dropped",
        "load_failed",
        "replay",
    ]
    assert events[0].sha1 == "-" and events[0].detail == "below min tokens"
    assert (events[2].tokens, events[2].files) == (640, 2)
    assert (events[3].tokens, events[3].ms) == (640, 12)
    saved = events[6]
    assert (saved.reason, saved.sha1, saved.tokens, saved.bytes, saved.ms) == (
        "cold",
        SHA,
        1920,
        7880704,
        42,
    )
    assert events[8].reason == "no_space" and events[9].bytes == 2629632
    dropped = events[11]
    assert (dropped.sha1, dropped.tokens, dropped.bytes) == (SHA, 512, 4096)
    assert dropped.detail == f"its chain's file {SHA} was quarantined"
    assert parse("unrelated line") is None


def test_the_file_rotates_at_its_cap_and_follows_logrotate(tmp_path, monkeypatch):
    import vllm_kvdisk.ops.trace as trace_mod

    monkeypatch.setattr(trace_mod, "CHECK_EVERY_S", 0.0)
    path = str(tmp_path / "t.log")
    t = Trace(path, max_bytes=2000)
    for _ in range(100):
        t.evicted(SHA, 1, 1)
    assert os.path.getsize(path) < 2000 + 200 and os.path.exists(path + ".1")
    assert len(read(path)) <= 100
    os.rename(path, path + ".rotated")  # logrotate moves it away
    t.evicted(SHA, 2, 2)
    assert read(path)[-1].tokens == 2  # written to a new file at the same path
    t.close()


def test_lookup_lines_name_their_request_and_parse_back_without_it(tmp_path):
    path = str(tmp_path / "t.log")
    t = Trace(path)
    t.miss(SHA, "prefix mismatch at byte 10 (token 3) of checkpoint " + SHA, "chatcmpl-1-a")
    t.hit(SHA, 640, 2, "0 already in the GPU cache", request="cmpl-2")
    t.device_hit(SHA, 3456, 1920, request="cmpl-3 \n(evil)")  # a client's header, say
    t.miss(None, "below min tokens")
    got = read(path)
    assert [(e.kind, e.request) for e in got] == [
        ("miss", "chatcmpl-1-a"),
        ("hit", "cmpl-2"),
        ("device_hit", "cmpl-3___evil_"),
        ("miss", ""),
    ]
    assert got[0].detail == "prefix mismatch at byte 10 (token 3) of checkpoint " + SHA
    assert got[1].detail == "0 already in the GPU cache" and got[1].tokens == 640
    assert len(open(path).read().splitlines()) == 4
