"""The ``kvdisk`` report of a response: where a prompt leaves its nearest checkpoint (real
files in a store), the object's fields, and the API server's part (the message a byte
falls in, the final chunk of a stream) against a small chat template."""

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import numpy as np
from synth import BLOCK, byte_table, make, planner, prompt_of, save

from vllm_kvdisk.api.report import OutputTap, Rendered, ResponseReports, locate
from vllm_kvdisk.core.index import Miss
from vllm_kvdisk.core.report import CacheReport, Divergence
from vllm_kvdisk.ops.diagnose import explain


def ids(text: bytes) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8).astype("<u4")


BASE = (
    b"<sys>You are a careful assistant. "
    + b"lorem ipsum dolor " * 8
    + b"</sys>"
    + (b"<user>What is the weather in Rome today, and what will it be tomorrow?</user>" * 3)
)


def stored(tmp_path, text: bytes = BASE):
    store, ns = make(tmp_path)
    prompt = prompt_of(ids(text))
    save(store, ns, prompt, len(text) // BLOCK * BLOCK, np.random.default_rng(0))
    return store, ns


def lookup(store, ns, text: bytes):
    prompt_ids = ids(text)
    return planner(store).lookup(ns, prompt_ids, len(prompt_ids) - 1), prompt_ids


def test_a_divergence_inside_a_checkpoint_names_its_byte_token_and_file(tmp_path):
    store, ns = stored(tmp_path)
    at = BASE.index(b"Rome", BASE.index(b"Rome") + 1)  # the second question's city
    changed = BASE[:at] + b"Oslo" + BASE[at + 4 :]
    got, prompt_ids = lookup(store, ns, changed)
    assert got.miss is Miss.PREFIX_MISMATCH
    refined, words, found = explain(store, byte_table(), ns, got, prompt_ids)
    assert refined is Miss.PREFIX_MISMATCH and found is not None
    assert (found.token, found.byte, found.checkpoint) == (at, at, got.diverged[0].sha1)
    assert words == f"prefix mismatch at byte {at} (token {at}) of checkpoint {found.checkpoint}"
    assert found.ours is None and found.theirs is None  # excerpts off: no text at all
    assert "excerpt" not in found.to_dict()


def test_a_divergence_in_the_first_block_names_the_nearest_root(tmp_path):
    store, ns = stored(tmp_path)
    dated = b"<sys>Today is 2026-12-04. " + BASE[5:]
    got, prompt_ids = lookup(store, ns, dated)
    assert got.segments == [] and got.miss is Miss.NO_CHECKPOINT
    assert [e.sha1 for e in got.diverged] == [e.sha1 for e in store.index.entries()]
    refined, words, found = explain(store, byte_table(), ns, got, prompt_ids)
    assert refined is Miss.NO_CHECKPOINT and found is not None  # the metric's label stays
    assert (found.reason, found.byte, found.token) == (Miss.PREFIX_MISMATCH, 5, 5)
    assert words.startswith("no checkpoint; nearest: prefix mismatch at byte 5 (token 5)")


def test_excerpts_are_bounded_and_only_when_asked(tmp_path):
    store, ns = stored(tmp_path)
    changed = BASE.replace(b"careful", b"sloppy!")
    got, prompt_ids = lookup(store, ns, changed)
    _, _, found = explain(store, byte_table(), ns, got, prompt_ids, excerpt_bytes=16)
    at = BASE.index(b"careful")
    assert found.byte == at
    assert found.ours == changed[at - 8 : at + 8].decode()
    assert found.theirs == BASE[at - 8 : at + 8].decode()
    assert found.to_dict()["excerpt"] == {"prompt": found.ours, "checkpoint": found.theirs}
    _, _, huge = explain(store, byte_table(), ns, got, prompt_ids, excerpt_bytes=1 << 20)
    assert len(huge.theirs.encode()) <= 1024


def test_the_report_object_has_its_documented_fields():
    report = CacheReport(1000, device_tokens=256, disk_tokens=512, checkpoint="a" * 40)
    report.reason = Miss.PREFIX_MISMATCH
    report.divergence = Divergence(Miss.PREFIX_MISMATCH, "b" * 40, 800, 3100)
    assert report.to_dict() == {
        "version": 1,
        "prompt_tokens": 1000,
        "device_tokens": 256,
        "disk_tokens": 512,
        "computed_tokens": 232,
        "checkpoint": "a" * 40,
        "reason": "prefix_mismatch",
        "divergence": {
            "reason": "prefix_mismatch",
            "checkpoint": "b" * 40,
            "token": 800,
            "byte": 3100,
        },
        "load_failed": False,
        "saves": [],
        "pin": None,
    }
    json.dumps(report.to_dict())  # plain JSON types only


# -- the API server's part -------------------------------------------------------------


@dataclasses.dataclass
class Params:
    chat_template_kwargs: dict


async def render(messages, params):
    """A ChatML-like template: tools inside the system turn, after its content."""
    kw = params.chat_template_kwargs
    out = "<|im_start|>system\n"
    if messages and messages[0]["role"] == "system":
        out += messages[0]["content"]
        messages_rest = messages[1:]
    else:
        messages_rest = messages
    if kw.get("tools"):
        out += "\n# Tools\n" + "\n".join(json.dumps(t) for t in kw["tools"])
    out += "<|im_end|>\n"
    for m in messages_rest:
        out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    if kw.get("add_generation_prompt"):
        out += "<|im_start|>assistant\n"
    return messages, {"prompt": out}


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Weather?"},
]
TOOLS = [{"name": "get_weather"}]


def rendered(messages=MESSAGES, tools=TOOLS) -> Rendered:
    params = Params({"tools": tools, "add_generation_prompt": True})
    _, out = asyncio.run(render(messages, params))
    return Rendered(messages, params, out["prompt"].encode())


def where(byte: int, r: Rendered | None = None):
    return asyncio.run(locate(byte, r or rendered(), render))


def test_each_byte_of_the_prompt_falls_in_its_message_or_the_tools():
    prompt = rendered().prompt
    assert where(prompt.index(b"Be brief")) == {"index": 0, "role": "system"}
    assert where(0) == {"index": 0, "role": "system"}
    assert where(prompt.index(b"\n# Tools")) == {"index": None, "role": "tools"}
    assert where(prompt.index(b"get_weather")) == {"index": None, "role": "tools"}
    assert where(prompt.index(b"Hi there")) == {"index": 1, "role": "user"}
    # the opening markup of a turn belongs to it: a role changed there is that message's
    assert where(prompt.index(b"<|im_start|>assistant")) == {"index": 2, "role": "assistant"}
    assert where(prompt.index(b"Weather?")) == {"index": 3, "role": "user"}
    assert where(len(prompt) - 3) is None  # the generation prompt: after every message
    no_tools = rendered(tools=None)
    assert where(no_tools.prompt.index(b"<|im_end|>"), no_tools) == {"index": 0, "role": "system"}


def test_a_failing_render_places_nothing():
    async def broken(messages, params):
        raise ValueError("template error")

    reports = ResponseReports(SimpleNamespace(render_messages_async=broken))
    params = {"kvdisk": {"divergence": {"byte": 3, "token": 1}}}
    asyncio.run(reports.annotate(params, [rendered()]))
    assert "message" not in params["kvdisk"]["divergence"]


def test_a_stream_carries_the_report_in_its_finishing_and_usage_chunks_only():
    class Output:
        def __init__(self, params):
            self.kv_transfer_params = params

    chat = rendered()

    async def outputs():
        yield Output(None)
        yield Output({"kvdisk": {"divergence": {"byte": chat.prompt.index(b"Hi")}}})

    def data(**chunk):
        return f"data: {json.dumps({'id': 'c1', 'object': 'x', **chunk})}\n\n"

    async def sse(tap):
        async for out in tap:
            done = out.kv_transfer_params is not None
            yield data(choices=[{"delta": {"content": "a"}, "finish_reason": None}])
            if done:
                yield data(choices=[{"delta": {}, "finish_reason": "stop"}])
        yield data(choices=[], usage={"prompt_tokens": 3})
        yield "data: [DONE]\n\n"

    async def run():
        reports = ResponseReports(SimpleNamespace(render_messages_async=render))
        tap = OutputTap(outputs())
        return [c async for c in reports.stream(sse(tap), tap, [chat])]

    chunks = asyncio.run(run())
    assert len(chunks) == 5 and chunks[-1] == "data: [DONE]\n\n"  # none added
    parsed = [json.loads(c[6:]) for c in chunks[:-1]]
    assert ["kv_transfer_params" in c for c in parsed] == [False, False, True, True]
    finishing, usage = parsed[2], parsed[3]
    assert finishing["choices"][0]["finish_reason"] == "stop" and usage["usage"]
    divergence = usage["kv_transfer_params"]["kvdisk"]["divergence"]
    assert divergence["message"] == {"index": 1, "role": "user"}


def test_placing_a_divergence_is_given_up_past_its_time_budget(monkeypatch):
    import vllm_kvdisk.api.report as api_report

    async def slow(messages, params):
        await asyncio.sleep(5)
        return await render(messages, params)

    monkeypatch.setattr(api_report, "LOCATE_BUDGET_S", 0.05)
    reports = ResponseReports(SimpleNamespace(render_messages_async=slow))
    params = {"kvdisk": {"divergence": {"byte": 3, "token": 1}}}
    asyncio.run(reports.annotate(params, [rendered()]))
    assert params["kvdisk"]["divergence"] == {"byte": 3, "token": 1}  # as the engine wrote it


def test_a_prewarm_body_is_checked_and_runs_as_one_token(tmp_path):
    import pytest

    from vllm_kvdisk.api.prewarm import BadPrewarm, checked_body, on_disk

    run, wait = checked_body({"messages": [{"role": "system", "content": "x"}], "wait_s": 5})
    assert (run["max_tokens"], run["stream"], wait) == (1, False, 5.0) and "wait_s" not in run
    for body, what in (
        ([], "JSON object"),
        ({"messages": []}, "messages"),
        ({"messages": [{}], "wait_s": 601}, "wait_s"),
        ({"messages": [{}], "wait_s": True}, "wait_s"),
        ({"messages": [{}], "stream": True}, "stream"),
        ({"messages": [{}], "kv_transfer_params": {"kvdisk": {"pin_s": 10**9}}}, "pin_s"),
        ({"messages": [{}], "kv_transfer_params": {"kvdisk": {"pin_s": "1h"}}}, "pin_s"),
    ):
        with pytest.raises(BadPrewarm, match=what):
            checked_body(body)
    sha = "ab" * 20
    (tmp_path / "ns1").mkdir()
    assert not on_disk(str(tmp_path), [sha])
    (tmp_path / "ns1" / f"{sha}.kv").write_bytes(b"")
    assert on_disk(str(tmp_path), [sha]) and on_disk(str(tmp_path), [])
    assert not on_disk(str(tmp_path), ["../../etc/passwd"])  # only names of checkpoints


def test_the_prewarm_route_answers_bad_bodies_and_an_unconfigured_server_clearly():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_kvdisk.api.prewarm import ROUTE, install

    root: list[str | None] = [None]
    app = FastAPI()
    install(app, lambda: root[0])
    client = TestClient(app)
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert client.post(ROUTE, json=body).status_code == 503  # before the plugin's init
    root[0], app.state.openai_serving_chat = "/nonexistent", object()
    bad = client.post(ROUTE, json={"messages": "x"})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]
