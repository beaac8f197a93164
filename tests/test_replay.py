"""Exact tool-call replay without an engine: the in-memory map, which turns replay, the
splice of the sampled ids, the tool maps read back from disk, the plugin's environment."""

import os

import numpy as np
from synth import FP, byte_table, prompt_of, save

from vllm_kvdisk.core.control import MAP_KEY
from vllm_kvdisk.replay.ktm import DiskToolMaps, load_tool_maps
from vllm_kvdisk.replay.memory import (
    ToolMemory,
    ToolRecord,
    exact_text,
    prefix_digest,
    strip_stop,
    tenant_key,
)
from vllm_kvdisk.replay.messages import make_signature
from vllm_kvdisk.replay.plugin import plugins_env
from vllm_kvdisk.replay.turns import plan_replay, sentinel_messages, splice
from vllm_kvdisk.storage.store import Store

# -- the map, planning, splicing (no engine) ---------------------------------------------
TENANT = tenant_key("", "")
MARKUP = [f"<{t}>" for t in "abcdef"] + [f"</{t}>" for t in "abcdef"]


def call(tag="a", args='{"city": "Rome"}'):
    """A sampled turn in a hermes-like syntax: the tags are the parser's markup."""
    return f'<{tag}>{{"name": "get_weather", "arguments": {args}}}</{tag}>'


def record(text=None, args='{"city": "Rome"}', content=None, origin="memory", prefix=None):
    return ToolRecord(
        text if text is not None else call(),
        (7, 8, 9),
        make_signature(content, [("get_weather", args)]),
        origin,
        tenant=TENANT,
        prefix=prefix if prefix is not None else prefix_digest(encode("<u>q</u><a>")),
    )


def encode(s):
    return [ord(c) for c in s]


def assistant(*ids, args='{"city": "Rome"}', content=None):
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": args}}
            for i in ids
        ],
    }


def test_tool_memory_is_an_lru_that_never_grows_past_its_limit():
    memory = ToolMemory(3)
    for i in range(5):
        memory.put(TENANT, f"id{i}", record())
        assert len(memory) <= 3
    assert [memory.contains(TENANT, f"id{i}") for i in range(5)] == [False, False, True, True, True]
    assert memory.get(TENANT, "id2") is not None  # a lookup makes id2 the most recent
    memory.put(TENANT, "id5", record())
    assert memory.contains(TENANT, "id2") and not memory.contains(TENANT, "id3")
    assert len(memory) == 3
    # A disk entry never replaces what this process saw itself.
    assert not memory.add_if_absent(TENANT, "id2", record("other", origin="disk"))
    assert memory.get(TENANT, "id2").origin == "memory"
    off = ToolMemory(0)
    off.put(TENANT, "x", record())
    assert len(off) == 0


def test_only_unchanged_messages_with_known_ids_are_replayed():
    memory = ToolMemory(10)
    memory.put(TENANT, "a", record(call("a")))
    memory.put(TENANT, "d", record(call("d"), origin="disk"))
    messages = [
        {"role": "user", "content": "hi"},
        assistant("a", args='{ "city" : "Rome" }'),  # JSON-equal: the same call
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        assistant("a", args='{"city": "Paris"}'),  # the client changed it
        assistant("a", content="I will look it up."),  # content the model never wrote
        assistant("zzz"),  # unknown id
        assistant("a", "zzz"),  # one id unknown: the message is not what was generated
        assistant("d"),
    ]
    plan = plan_replay(messages, memory, sign=lambda r: None, tenant=TENANT, markup=MARKUP)
    assert [(r.index, r.ids) for r in plan.replays] == [(1, ["a"]), (7, ["d"])]
    assert (plan.from_memory, plan.from_disk, plan.missing, plan.changed) == (1, 1, 2, 3)
    assert plan.summary() == (
        "1 from memory, 1 from disk, 2 missing, 3 changed (as the template renders: "
        "message 3: it differs from what was sampled; message 4: it differs from what was "
        "sampled; message 5: 1 of 1 call(s) unknown; +1 more)"
    )
    assert plan.tool_map() == [["a", call("a")], ["d", call("d")]]
    # A disk record is compared once the server's parser has signed it.
    memory.put(TENANT, "e", ToolRecord(call("e"), None, None, "disk", ("ns", "sha1"), TENANT))
    signed = plan_replay(
        [assistant("e")],
        memory,
        sign=lambda r: make_signature(None, [("get_weather", {"city": "Rome"})]),
        tenant=TENANT,
        markup=MARKUP,
    )
    assert [r.ids for r in signed.replays] == [["e"]] and signed.from_disk == 1
    memory.put(TENANT, "f", ToolRecord(call("f"), None, None, "disk", ("ns", "sha1"), TENANT))
    unparsable = plan_replay([assistant("f")], memory, sign=lambda r: None, tenant=TENANT)
    assert not unparsable.replays and unparsable.changed == 1


def test_splice_puts_the_sampled_tokens_where_the_sentinel_was():
    memory = ToolMemory(10)
    memory.put(TENANT, "a", record())
    messages = [{"role": "user", "content": "q"}, assistant("a"), {"role": "user", "content": "r"}]
    plan = plan_replay(messages, memory, sign=lambda r: None, tenant=TENANT, markup=MARKUP)
    swapped, sentinels = sentinel_messages(messages, plan.replays)
    assert swapped[1] == {"role": "assistant", "content": sentinels[0]}
    assert messages[1]["tool_calls"]  # the request's own messages are left alone
    text = f"<u>q</u><a>{sentinels[0]}</a><u>r</u>"
    ids, exact = splice(text, sentinels, plan.replays, encode)
    assert exact == f"<u>q</u><a>{call()}</a><u>r</u>"
    assert ids == encode("<u>q</u><a>") + [7, 8, 9] + encode("</a><u>r</u>")
    assert splice("no sentinel here", sentinels, plan.replays, encode) is None
    assert splice(text + sentinels[0], sentinels, plan.replays, encode) is None
    plan.replays[0].record.token_ids = None  # text only: the exact text is tokenized
    assert splice(text, sentinels, plan.replays, encode)[0] == encode(exact)


def test_exact_text_is_the_checkpoint_text_of_the_sampled_ids():
    table = byte_table()
    assert strip_stop([104, 105, 0, 1, 1], special_ids={1}) == [104, 105, 0]
    assert exact_text(table, [104, 105, 257]) == "hié"
    assert exact_text(table, [104, 259]) is None  # cut inside a character
    assert exact_text(table, []) is None


def test_tool_maps_are_rebuilt_from_the_ktm_sections_on_disk(tmp_path):
    root = str(tmp_path / "cache")
    store = Store(root, space_bytes=1 << 30)
    ns = store.ensure_namespace(FP)
    table, rng = byte_table(), np.random.default_rng(0)
    ids = np.random.default_rng(1).integers(97, 123, 300)
    ids[100:110] = [ord(c) for c in "<call one>"]
    prompt = prompt_of(ids)
    save(store, ns, prompt, 112, rng, tool_map=[("one", "<call one>")], now=1_000)
    save(store, ns, prompt, 240, rng, tool_map=[("one", "<call one>"), ("two", "ne>")], now=2_000)
    with open(os.path.join(store.ns_dir(ns), "0" * 40 + ".kv"), "wb") as fh:
        fh.write(b"KVC garbage")  # unreadable files are skipped, never moved (read-only)
    pairs = load_tool_maps(root)
    assert sorted(pairs) == [("one", "<call one>"), ("two", "ne>")]
    assert os.path.exists(os.path.join(store.ns_dir(ns), "0" * 40 + ".kv"))
    disk = DiskToolMaps(root)
    found = {tid: (n, s) for tid, _, n, s, _ in disk.poll()}
    assert disk.poll() == []  # each file is read once
    assert (
        disk.recover_tokens(*found["one"], "<call one>", table)
        == (
            prefix_digest(ids[:100]),  # the prompt before the call: what it was sampled after
            tuple(ids[100:110]),
        )
    )
    assert disk.recover_tokens(*found["one"], "not there", table) is None
    assert load_tool_maps(str(tmp_path / "missing")) == []


def test_plugins_env_enables_the_endpoint_plugin_and_keeps_the_others():
    names = plugins_env(None).split(",")
    assert "kvdisk" in names and "kvdisk_replay" in names
    assert "lora_hf_hub_resolver" not in names  # named means "allowed to download": opt-in
    assert plugins_env("other") == "other,kvdisk,kvdisk_replay"
    assert plugins_env("kvdisk_replay,kvdisk") == "kvdisk_replay,kvdisk"


def test_map_key_is_the_one_the_connector_reads():
    from vllm_kvdisk.core.control import RequestControl, tool_entries

    class Request:
        kv_transfer_params = {"client": 1, MAP_KEY: [["id-1", "<call>"], ["id-2", "absent"]]}

    control = RequestControl.from_request(Request())
    assert tool_entries(control, b"prompt <call> rest") == [("id-1", "<call>")]
