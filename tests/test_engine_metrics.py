"""vllm:kvdisk_* metrics on the server's own /metrics match what happened."""

import glob
import json
import os
import re
import time

import pytest
from engine import OUTCOME_WAIT_S, Server, disk_tokens, events
from helpers import text

from vllm_kvdisk.storage.fileread import read_meta

pytestmark = pytest.mark.engine
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scrape_names(server: Server) -> set[str]:
    import requests

    body = requests.get(server.url + "/metrics", timeout=30).text
    return {
        line.split("{")[0].split(" ")[0] for line in body.splitlines() if line.startswith("vllm:")
    }


def wait_for(predicate, timeout=OUTCOME_WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_metrics_follow_a_chat(tiny_model, tmp_path):
    kv, trace, log = str(tmp_path / "kv"), str(tmp_path / "trace.txt"), str(tmp_path / "log")
    server = Server(tiny_model, kv, log, "--trace", trace)
    m = server.metric
    try:
        messages = [
            {"role": "system", "content": text(0, 900)},
            {"role": "user", "content": text(900, 200)},
        ]
        reply = server.chat(messages)
        assert wait_for(lambda: m("vllm:kvdisk_saves_total") >= len(events(trace, "saved")) > 0)
        assert m("vllm:kvdisk_tokens_loaded_total") == 0  # nothing on disk before turn 1
        assert m("vllm:kvdisk_lookups_total", result="miss", reason="no_checkpoint") == 1
        assert m("vllm:kvdisk_prompt_tokens_looked_up_total") == reply["usage"]["prompt_tokens"]
        messages += [reply["choices"][0]["message"], {"role": "user", "content": text(1300, 60)}]
        server.chat(messages)  # the device cache serves it
        assert m("vllm:kvdisk_lookups_total", result="device_hit") == 1
        server.reset_device_cache()
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        before = disk_tokens(server)
        cached = server.chat(messages)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert m("vllm:kvdisk_lookups_total", result="hit") == 1
        loaded = m("vllm:kvdisk_tokens_loaded_total")
        assert loaded == cached == disk_tokens(server) - before > 0
        traced = sum(e.tokens for e in events(trace, "loaded"))
        assert loaded == traced
        assert m("vllm:kvdisk_load_seconds_count") == 1
        assert m("vllm:kvdisk_bytes_read_total") > 0
        assert wait_for(lambda: m("vllm:kvdisk_saves_total") == len(events(trace, "saved")))
        for reason in ("cold", "continued", "evict", "shutdown"):
            assert m("vllm:kvdisk_saves_total", reason=reason) == len(
                [e for e in events(trace, "saved") if e.reason == reason]
            )
        files = [p for p in glob.glob(os.path.join(kv, "*", "*.kv")) if "quarantine" not in p]
        assert m("vllm:kvdisk_disk_files") == len(files)
        assert m("vllm:kvdisk_disk_bytes") == sum(os.path.getsize(p) for p in files)
        assert m("vllm:kvdisk_bytes_written_total") == sum(os.path.getsize(p) for p in files)
        assert m("vllm:kvdisk_save_seconds_count") == len(files)
        # The pages' bytes on disk (compressed by default) against the same pages decoded.
        stored, decoded = 0, 0
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                meta = read_meta(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            stored, decoded = stored + meta.offsets.stored_bytes, decoded + meta.offsets.raw_bytes
        assert m("vllm:kvdisk_page_bytes_stored_total") == stored
        assert m("vllm:kvdisk_page_bytes_decoded_total") == decoded > stored
        assert m("vllm:kvdisk_disk_budget_bytes") == 8192 * 1024 * 1024
        assert m("vllm:kvdisk_pending_writes") == 0
        assert m("vllm:kvdisk_errors_total") == 0 and m("vllm:kvdisk_saves_skipped_total") == 0
        names = scrape_names(server)
        # An operator clears this model's disk cache through vLLM's own route.
        assert server.reset_prefix_cache(external=True) == {"success": True}
        assert not [p for p in glob.glob(os.path.join(kv, "*", "*.kv")) if "quarantine" not in p]
        server.chat([{"role": "user", "content": "hi"}], max_tokens=2)  # a step: gauges update
        assert wait_for(lambda: m("vllm:kvdisk_disk_files") == 0)
    finally:
        server.stop()
    # The cache's own log lines come out through vLLM's logging (level, time, pid).
    started = [line for line in open(log, errors="replace") if "kvdisk: 0 checkpoint(s)" in line]
    assert started and "INFO" in started[0] and "pid=" in started[0], started
    # Every metric the dashboard and the README use is one the server really exports.
    dashboard = open(
        os.path.join(ROOT, "deploy", "helm", "vllm-kvdisk", "dashboards", "kvdisk-dashboard.json")
    ).read()
    readme = open(os.path.join(ROOT, "README.md")).read()
    used = set(re.findall(r"vllm:kvdisk_[a-z_]+", dashboard + readme))
    exported = {re.sub(r"_(bucket|count|sum|created)$", "", n) for n in names} | names
    assert used and used <= exported, sorted(used - exported)
    assert json.loads(dashboard)["panels"]
