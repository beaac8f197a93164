"""The kvdisk command-line tool on a real directory of synthetic checkpoints."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from synth import FP, prompt_of, save

from vllm_kvdisk.ops.cli import main
from vllm_kvdisk.storage.store import Store


@pytest.fixture()
def cache(tmp_path):
    store = Store(str(tmp_path / "kv"), space_bytes=1 << 30)
    ns = store.ensure_namespace(FP)
    rng = np.random.default_rng(0)
    text_ids = list(b"System: you are a helpful assistant.\n" * 12)
    prompt = prompt_of(text_ids)
    root, _ = save(store, ns, prompt, 112, rng)
    child, _ = save(store, ns, prompt, 240, rng, tool_map=[("call_1", '{"x": 1}')])
    return store, ns, root, child


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ls_table_and_json(cache, capsys):
    store, ns, root, child = cache
    code, out, _ = run(capsys, "ls", store.root)
    assert code == 0 and root.sha1[:12] in out and "System: you are" in out and "cold" in out
    code, out, _ = run(capsys, "ls", store.root, "--json")
    rows = json.loads(out)
    assert {r["sha1"] for r in rows} == {root.sha1, child.sha1}
    by = {r["sha1"]: r for r in rows}
    assert by[child.sha1]["parent"] == root.sha1 and by[child.sha1]["tokens"] == 240


def test_inspect_shows_header_layout_chain_and_tools(cache, capsys):
    store, ns, root, child = cache
    code, out, _ = run(capsys, "inspect", store.path(ns, child.sha1), "--json")
    info = json.loads(out)
    assert code == 0
    assert (info["tokens"], info["parent_tokens"], info["reason"], info["delta"]) == (
        240,
        112,
        "cold",
        True,
    )
    assert [c["sha1"] for c in info["chain"]] == [root.sha1, child.sha1]
    assert info["tool_ids"] == ["call_1"] and info["layout"]["name"] == "test:LBHNC"
    code, out, _ = run(capsys, "inspect", store.path(ns, child.sha1))
    assert "chain" in out and "->" in out


def test_verify_reports_and_fixes(cache, capsys):
    store, ns, root, child = cache
    assert run(capsys, "verify", store.root)[0] == 0
    path = store.path(ns, child.sha1)
    raw = bytearray(open(path, "rb").read())
    raw[-200] ^= 1
    open(path, "wb").write(raw)
    code, out, _ = run(capsys, "verify", store.root)
    assert code == 1 and "checksum mismatch" in out and os.path.exists(path)  # read-only
    code, out, _ = run(capsys, "verify", store.root, "--fix", "--json")
    assert code == 1 and json.loads(out)["fixed"] == 1 and not os.path.exists(path)
    assert run(capsys, "verify", store.root)[0] == 0


def test_gc_and_stats(cache, capsys):
    store, ns, root, child = cache
    code, out, _ = run(capsys, "stats", store.root, "--json")
    stats = json.loads(out)
    assert (
        stats["files"] == 2 and stats["tokens_stored"] == 240 and stats["by_reason"] == {"cold": 2}
    )
    assert stats["namespaces"][0]["model"] == "tiny" and stats["namespaces"][0]["files"] == 2
    code, out, _ = run(capsys, "stats", store.root)
    assert "2 checkpoint(s)" in out and "KiB" in out and "tiny @ main" in out
    code, out, _ = run(capsys, "gc", store.root, "--to-mb", "0", "--dry-run")
    assert code == 0 and "would remove 2 file(s)" in out and len(os.listdir(store.ns_dir(ns))) == 3
    code, out, _ = run(capsys, "gc", store.root, "--to-mb", "0")
    assert code == 0 and "removed 2" in out  # the leaf first, then its parent


def test_rm_removes_one_model_and_says_which(cache, capsys, tmp_path):
    store, ns, root, child = cache
    from vllm_kvdisk.core.keys import Fingerprint

    other = store.ensure_namespace(Fingerprint("other-model", "r1", "float32", "x", 16, 1, 0))
    code, out, err = run(capsys, "rm", store.root, "--model", "nope")
    assert code == 2 and "no namespace" in err
    code, out, _ = run(capsys, "rm", store.root, "--model", "tiny", "--dry-run")
    assert code == 0 and "would remove 2 file(s)" in out and os.path.isdir(store.ns_dir(ns))
    code, out, _ = run(capsys, "rm", store.root, "--model", "tiny", "--json")
    assert json.loads(out)["namespaces"][0]["files"] == 2
    assert not os.path.exists(store.ns_dir(ns)) and os.path.isdir(store.ns_dir(other))


def test_human_output_and_version(cache, capsys):
    store, ns, root, child = cache
    code, out, _ = run(capsys, "ls", store.root)
    assert f"namespace {ns}: tiny @ main" in out and "KiB" in out and "112..240" in out
    code, out, _ = run(capsys, "inspect", store.path(ns, child.sha1))
    assert "created" in out and "ago" in out and "{" not in out.split("text")[0]
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and "kvdisk" in capsys.readouterr().out
    code, out, _ = run(capsys, "verify", store.root, "--jobs", "3")
    assert code == 0 and "checked 2 files" in out


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    assert run(capsys, "ls", str(tmp_path / "missing"))[0] == 2
    bogus = tmp_path / ("a" * 40 + ".kv")
    bogus.write_bytes(b"not a checkpoint")
    code, _, err = run(capsys, "inspect", str(bogus))
    assert code == 2 and "not a valid checkpoint" in err
    code, _, err = run(capsys, "inspect", str(tmp_path / "x.txt"))
    assert code == 2 and "sha1" in err


def test_console_script_runs_without_vllm(cache):
    store = cache[0]
    out = subprocess.run(
        [sys.executable, "-m", "vllm_kvdisk.ops.cli", "stats", store.root],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "2 checkpoint(s)" in out.stdout


def test_inspect_shows_the_kv_cache_groups_of_a_hybrid_file(tmp_path, capsys):
    from synth import LAYOUT, planner

    from vllm_kvdisk.core.encode import encode_plan
    from vllm_kvdisk.core.format import Group, GroupKind, Reason

    store = Store(str(tmp_path / "kv"), space_bytes=1 << 30)
    ns = store.ensure_namespace(FP)
    prompt = prompt_of(list(range(200)))
    plan = planner(store).plan_save(ns, prompt, 160, Reason.COLD)
    groups = (Group(GroupKind.WINDOW, 1, window=40), Group(GroupKind.FULL, 1))
    page = LAYOUT.page_bytes
    # 160 tokens of 16: the full layer holds 10 blocks, the window layer 40 - 1 tokens
    # back from 160 (blocks 7..9)
    enc = encode_plan(
        plan,
        text=prompt.text_upto(160),
        ids=prompt.ids,
        layers=[bytes(3 * page), bytes(10 * page)],
        layout=LAYOUT,
        fingerprint=FP.digest(),
        kv_dtype="float32",
        context_size=8192,
        now=1_000_000,
        groups=groups,
    )
    store.write(ns, plan.sha1, enc)
    code, out, _ = run(capsys, "inspect", store.path(ns, plan.sha1), "--json")
    assert code == 0 and json.loads(out)["groups"] == [
        {"kind": "window", "layers": 1, "window": 40, "first_block": 7, "blocks": 3},
        {"kind": "full", "layers": 1, "window": 0, "first_block": 0, "blocks": 10},
    ]
    code, out, _ = run(capsys, "inspect", store.path(ns, plan.sha1))
    assert "window 40: 1 layer(s) x blocks 7..10; full: 1 layer(s) x blocks 0..10" in out
    # a state group (Mamba / Gated-DeltaNet): one block, the state after the last token
    prompt = prompt_of(list(range(300, 500)))
    plan = planner(store).plan_save(ns, prompt, 160, Reason.COLD)
    enc = encode_plan(
        plan,
        text=prompt.text_upto(160),
        ids=prompt.ids,
        layers=[bytes(page), bytes(10 * page)],
        layout=LAYOUT,
        fingerprint=FP.digest(),
        kv_dtype="float32",
        context_size=8192,
        now=1_000_000,
        groups=(Group(GroupKind.STATE, 1), Group(GroupKind.FULL, 1)),
    )
    store.write(ns, plan.sha1, enc)
    code, out, _ = run(capsys, "inspect", store.path(ns, plan.sha1), "--json")
    assert code == 0 and json.loads(out)["payload_version"] == 3
    assert json.loads(out)["groups"][0] == {
        "kind": "state",
        "layers": 1,
        "window": 0,
        "first_block": 9,
        "blocks": 1,
    }
    code, out, _ = run(capsys, "inspect", store.path(ns, plan.sha1))
    assert "state after 160 tokens: 1 layer(s) x block 9; full: 1 layer(s) x blocks 0..10" in out


# -- kvdisk why ---------------------------------------------------------------------------
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "c"}'},
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


def chat(tmp_path, name, system="Be brief.", question="Weather in Rome?", args=None, tools=(TOOL,)):
    call = dict(
        CALL, function=dict(CALL["function"], arguments=args or CALL["function"]["arguments"])
    )
    body = {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": list(tools),
    }
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return str(path)


def test_why_names_the_usual_invalidators(tmp_path, capsys):
    base = chat(tmp_path, "a.json")
    cases = {
        "date": (chat(tmp_path, "b.json", system="Today is 2026-12-04. Be brief."), 0, "system"),
        "tool": (chat(tmp_path, "c.json", tools=(TOOL, dict(TOOL, x=1))), None, "tools"),
        "edit": (chat(tmp_path, "d.json", question="Weather in Oslo?"), 1, "user"),
        "json": (chat(tmp_path, "e.json", args='{"unit": "c", "city": "Rome"}'), 2, "assistant"),
    }
    for name, (other, index, role) in cases.items():
        code, out, _ = run(capsys, "why", base, other, "--json")
        got = json.loads(out)
        assert code == 0 and got["message"] == {"index": index, "role": role}, (name, got)
        assert got["reason"] == "prefix_mismatch"
    assert json.loads(run(capsys, "why", base, cases["json"][0], "--json")[1])["what"] == (
        "arguments_reserialised"
    )
    code, out, _ = run(capsys, "why", base, cases["edit"][0])
    assert (
        out.splitlines()[0] == "prefix mismatch in message 1 (user) at character 11 of its content"
    )
    assert "A: Weather in Rome?" in out and "B: Weather in Oslo?" in out
    assert run(capsys, "why", base, base)[1] == "the same prompt: nothing differs\n"


def test_why_of_two_texts_names_the_byte_line_and_column(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(b"line one\nline two\x1b[2J\n")
    b.write_bytes(b"line one\nline 2\n")
    code, out, _ = run(capsys, "why", str(a), str(b))
    assert code == 0 and out.startswith("prefix mismatch at byte 14 (line 2, column 5)")
    assert "\x1b" not in out  # a file's control characters are escaped


def test_why_of_a_request_reads_its_lookups_from_the_trace(tmp_path, capsys):
    from vllm_kvdisk.ops.trace import Trace

    path = str(tmp_path / "trace.txt")
    t = Trace(path)
    t.miss(None, "no checkpoint", "chatcmpl-abc-0")
    t.miss("0" * 40, "prefix mismatch at byte 9 (token 3) of checkpoint " + "0" * 40, "other")
    code, out, _ = run(capsys, "why", "--trace", path, "chatcmpl-abc")
    assert code == 0 and out.count("\n") == 1 and "no checkpoint; request=chatcmpl-abc-0" in out
    code, _, err = run(capsys, "why", "--trace", path, "nobody")
    assert code == 1 and "no lookup of request nobody" in err
    code, _, err = run(capsys, "why", str(tmp_path / "missing.json"), path)
    assert code == 2 and "missing.json" in err
    code, _, err = run(capsys, "why", path)
    assert code == 2 and "two prompt files" in err
