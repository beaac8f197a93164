"""Every response says what the disk cache did (`kv_transfer_params.kvdisk`), and where a
changed conversation left its nearest checkpoint: the usual invalidators of a prompt
cache on a real `vllm-kvdisk serve`, one server, each case under its own cache salt (so
each compares with its own first conversation only)."""

import json
import os

import pytest
import requests
from engine import Server, shared_prefix, wait_until
from helpers import TOOL_ARGS, WEATHER, text

pytestmark = pytest.mark.engine

CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SYSTEM = "You are a careful assistant. " + text(0, 200)


QUESTION = "zebra " + text(300, 120)


def conversation(*, system=SYSTEM, question=QUESTION, args='{"city": "Rome", "unit": "c"}'):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": args},
    }
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": text(500, 80)},
        {"role": "user", "content": "And tomorrow? " + text(700, 60)},
    ]


def body(server, messages, salt, tools, **extra):
    return {
        "model": server.model,
        "messages": messages,
        "tools": tools,
        "max_tokens": 16,
        "temperature": 0,
        "cache_salt": salt,
        **extra,
    }


def report(server, messages, salt, tools=(WEATHER,), **extra) -> tuple[dict, str]:
    r = requests.post(
        server.url + "/v1/chat/completions",
        json=body(server, messages, salt, list(tools), **extra),
        timeout=300,
    )
    r.raise_for_status()
    return r.json()["kv_transfer_params"]["kvdisk"], r.text


def streamed_report(server, messages, salt, tools=(WEATHER,)) -> tuple[dict, str, dict]:
    chunks = []
    with requests.post(
        server.url + "/v1/chat/completions",
        json=body(server, messages, salt, list(tools), stream=True),
        stream=True,
        timeout=300,
    ) as r:
        r.raise_for_status()
        raw = r.content.decode()
    for line in raw.splitlines():
        if line.startswith("data: {"):
            chunks.append(json.loads(line[6:]))
    assert raw.rstrip().endswith("data: [DONE]")
    final = chunks[-1]  # the last choice's chunk (no usage asked): no chunk is added
    assert final["choices"][0]["finish_reason"] and final["id"] == chunks[0]["id"]
    assert all("kv_transfer_params" not in c for c in chunks[:-1])
    return final["kv_transfer_params"]["kvdisk"], raw, final


def tokens(server, messages, tools) -> list[int]:
    return server.post(
        "/tokenize", {"model": server.model, "messages": messages, "tools": list(tools)}
    )["tokens"]


def stored(server, messages, salt, tools=(WEATHER,), **extra) -> dict:
    """Send the first conversation, then wait until the disk holds all of it: the same
    prompt, with the device cache emptied, is then served from disk as deep as a lookup
    goes (its report names no reason)."""
    first, _ = report(server, messages, salt, tools, **extra)
    assert first["disk_tokens"] == 0 and first["prompt_tokens"] > 600

    def on_disk() -> bool:
        server.reset_device_cache()
        again, _ = report(server, messages, salt, tools, max_tokens=1)
        return again["reason"] is None and again["disk_tokens"] > 0

    wait_until("the first conversation's checkpoints on disk", on_disk)
    return first


def tool_server(model: str, tmp_path, *args: str) -> Server:
    """`vllm-kvdisk serve` that parses tool calls, its cache in ``tmp_path/kv``."""
    return Server(model, str(tmp_path / "kv"), str(tmp_path / "log"), *TOOL_ARGS, *args)


def test_each_invalidator_is_named_with_its_message_offset_and_reason(tiny_model, tmp_path):
    server = tool_server(tiny_model, tmp_path)
    try:
        base = conversation()
        cases = {
            # (a) the date at the top of the system prompt: the first block differs
            "date": (conversation(system="Today is 2026-12-04. " + SYSTEM), (WEATHER,)),
            # (b) one more tool
            "tool": (base, (WEATHER, CLOCK)),
            # (c) an earlier user message edited (streamed)
            "edit": (conversation(question="yak " + text(300, 120)), (WEATHER,)),
            # (d) the same call arguments, serialised with the keys in another order
            "json": (conversation(args='{"unit": "c", "city": "Rome"}'), (WEATHER,)),
        }
        expected = {
            "date": ({"index": 0, "role": "system"}, "no_checkpoint"),
            "tool": ({"index": None, "role": "tools"}, "prefix_mismatch"),
            "edit": ({"index": 1, "role": "user"}, "prefix_mismatch"),
            "json": ({"index": 2, "role": "assistant"}, "prefix_mismatch"),
        }
        for name, (messages, tools) in cases.items():
            stored(server, base, name)
            at = shared_prefix(tokens(server, base, (WEATHER,)), tokens(server, messages, tools))
            if name == "edit":
                got, raw, _ = streamed_report(server, messages, name, tools)
            else:
                got, raw = report(server, messages, name, tools)
            message, reason = expected[name]
            div = got["divergence"]
            assert div is not None, (name, got)
            assert (div["message"], div["token"], got["reason"]) == (message, at, reason), (
                name,
                got,
            )
            assert div["reason"] == "prefix_mismatch" and len(div["checkpoint"]) == 40
            assert div["byte"] > 0 and "excerpt" not in div
            assert (
                got["prompt_tokens"]
                == got["device_tokens"] + got["disk_tokens"] + got["computed_tokens"]
            )
            # Excerpts are off: nothing of the first conversation's own text comes back.
            if name == "edit":
                assert "zebra" not in raw
    finally:
        assert server.stop()["rc"] == 0


def test_excerpts_when_enabled_come_only_from_the_requests_own_salt(tiny_model, tmp_path):
    server = tool_server(tiny_model, tmp_path, "--kv-diagnose-excerpt-bytes", "40")
    try:
        stored(server, conversation(), "tenant-a")
        edited = conversation(question="yak " + text(300, 120))
        # Another salt: tenant-a's checkpoint is never compared, its text never sent.
        other, raw = report(server, edited, "tenant-b")
        assert other["divergence"] is None and other["disk_tokens"] == 0
        assert "zebra" not in raw
        # The same salt: both sides around the divergence, bounded.
        own, _ = report(server, edited, "tenant-a")
        excerpt = own["divergence"]["excerpt"]
        assert "zebra" in excerpt["checkpoint"] and "yak" in excerpt["prompt"]
        assert len(excerpt["checkpoint"].encode()) <= 40 and len(excerpt["prompt"].encode()) <= 40
        # A completions stream ends with the report too.
        with requests.post(
            server.url + "/v1/completions",
            json={
                "model": server.model,
                "prompt": text(0, 300),
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
                "cache_salt": "tenant-c",
            },
            stream=True,
            timeout=300,
        ) as r:
            r.raise_for_status()
            lines = [x for x in r.content.decode().splitlines() if x.startswith("data: {")]
        final = json.loads(lines[-1][6:])  # usage asked for: the usage chunk is the last
        kv = final["kv_transfer_params"]["kvdisk"]
        assert final["usage"] and kv["prompt_tokens"] == kv["computed_tokens"] > 128
        assert "kv_transfer_params" in json.loads(lines[-2][6:])  # and the finishing one
    finally:
        assert server.stop()["rc"] == 0


def test_a_pinned_prefix_survives_gc_and_a_prewarmed_one_is_the_first_requests_disk_hit(
    tiny_model, tmp_path
):
    from helpers import kv_files

    from vllm_kvdisk.ops.cli import main as kvdisk
    from vllm_kvdisk.storage import pins

    kv = str(tmp_path / "kv")
    server = tool_server(tiny_model, tmp_path)
    try:
        pinned, plain = conversation(), conversation(question="yak " + text(300, 120))
        first = stored(server, pinned, "pinned", kv_transfer_params={"kvdisk": {"pin_s": 3600}})
        assert first["pin"] == {"seconds": 3600} and first["saves"]
        assert stored(server, plain, "plain")["pin"] is None

        def pinned_files() -> set[str]:
            try:
                raw = open(os.path.join(kv, pins.NAME), "rb").read()
            except FileNotFoundError:
                return set()
            return {os.path.join(kv, ns, sha1 + ".kv") for ns, sha1 in pins.parse(raw)[0]}

        def pinned_namespace() -> set[str]:
            spaces = {os.path.dirname(f) for f in pinned_files()}
            return {f for f in kv_files(kv) if os.path.dirname(f) in spaces}

        wait_until(
            "every file of the pinned request pinned",
            lambda: pinned_files() and (pinned_files() == pinned_namespace()),
        )
        kept = pinned_namespace()
        assert kept and set(kv_files(kv)) - kept  # the plain conversation's files too
        assert kvdisk(["gc", kv, "--to-mb", "0"]) == 0
        assert set(kv_files(kv)) == kept  # every unpinned file went, no pinned one
        server.reset_device_cache()
        again, _ = report(server, pinned, "pinned", max_tokens=1)
        assert again["disk_tokens"] > 0 and again["reason"] is None

        # A prewarm: the shared system prompt alone, answered once its files are on disk.
        system = [{"role": "system", "content": "Fleet rules. " + text(900, 300)}]
        r = requests.post(
            server.url + "/v1/kvdisk/prewarm",
            json={"model": server.model, "messages": system, "cache_salt": "fleet"},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        warm = r.json()
        assert warm["on_disk"] and warm["checkpoints"] and warm["prompt_tokens"] > 256
        assert all(any(f.endswith(s + ".kv") for f in kv_files(kv)) for s in warm["checkpoints"])
        server.reset_device_cache()  # the first real request of another replica, as it were
        first, _ = report(
            server, system + [{"role": "user", "content": "Hello"}], "fleet", max_tokens=1
        )
        assert first["disk_tokens"] >= warm["prompt_tokens"] // 128 * 128 - 128 > 0
        assert first["checkpoint"] in warm["checkpoints"]
        bad = requests.post(server.url + "/v1/kvdisk/prewarm", json={"messages": "hi"}, timeout=60)
        assert bad.status_code == 400 and "messages" in bad.json()["error"]
    finally:
        assert server.stop()["rc"] == 0
