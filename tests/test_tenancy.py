"""Tenants on one cache directory: what a lookup, the CLI and the files on disk may say
about another tenant (cache salt), and what each tenant costs."""

from __future__ import annotations

import numpy as np
from synth import FP, planner, prompt, save

from vllm_kvdisk.core.index import Miss
from vllm_kvdisk.core.keys import Fingerprint
from vllm_kvdisk.storage.store import Store


def test_a_miss_never_names_another_salts_namespace(tmp_path):
    """Salt A's files hold the prompt's prefix; a lookup under salt B must read the same
    as a lookup of a prompt nobody stored (else /metrics confirms A's prompt to B). The
    same tenant's files of another model are still named: an operator's diagnostic."""
    store = Store(str(tmp_path / "kv"), space_bytes=1 << 30)
    salt_a, salt_b = "a" * 32, "b" * 32
    ns_a = store.ensure_namespace(FP.scoped("", salt_a))
    ns_b = store.ensure_namespace(FP.scoped("", salt_b))
    other_model = Fingerprint("other-model", "main", "float32", "x", 16, 1, 0, salt_digest=salt_a)
    ns_a2 = store.ensure_namespace(other_model)
    p = prompt(3)
    save(store, ns_a, p, 112, np.random.default_rng(0))
    look = planner(store).lookup
    got_b = look(ns_b, p.ids, 399, store.peers("", salt_b))
    unknown = look(ns_b, prompt(4).ids, 399, store.peers("", salt_b))
    assert got_b.miss is Miss.NO_CHECKPOINT and got_b.other_namespaces == ()
    assert (got_b.miss, got_b.other_namespaces) == (unknown.miss, unknown.other_namespaces)
    got_lora = look(ns_b, p.ids, 399, store.peers("adapter", salt_a))  # another scope
    assert got_lora.miss is Miss.NO_CHECKPOINT
    same_tenant = look(ns_a2, p.ids, 399, store.peers("", salt_a))
    assert same_tenant.miss is Miss.OTHER_NAMESPACE and same_tenant.other_namespaces == (ns_a,)


HOSTILE = "\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIH4=\x07\x1b[8mhidden\x1b[0m\x9b31m\x7f\u202e"


def test_the_cli_prints_client_text_escaped(tmp_path, capsys):
    """A prompt, a tool id and a namespace description with ESC / OSC / CSI / C1 / DEL /
    bidi characters: ``ls``, ``inspect`` and ``verify`` never print one raw."""
    from synth import prompt_of

    from vllm_kvdisk.ops.cli import main

    store = Store(str(tmp_path / "kv"), space_bytes=1 << 30)
    fp = Fingerprint("m" + HOSTILE, "main", "float32", FP.layout, 16, 1, 0, lora="l" + HOSTILE)
    ns = store.ensure_namespace(fp)
    p = prompt_of(list(("System: " + HOSTILE + " be kind. ").encode() * 8))
    plan, _ = save(store, ns, p, 112, np.random.default_rng(0), tool_map=[(HOSTILE, "{}")])
    outputs = []
    for argv in (
        ["ls", store.root],
        ["ls", store.root, "--json"],
        ["inspect", store.path(ns, plan.sha1)],
        ["inspect", store.path(ns, plan.sha1), "--json"],
        ["stats", store.root],
        ["verify", store.root],
    ):
        assert main(argv) == 0, argv
        out = capsys.readouterr()
        outputs.append((argv, out.out + out.err))
    for argv, text in outputs:
        raw = [c for c in "\x1b\x07\x9b\x7f\u202e" if c in text]
        assert not raw, (argv, raw)
    ls, inspect = outputs[0][1], outputs[2][1]
    assert "\\x1b]0;owned\\x07" in ls and "\\x1b[8mhidden" in ls  # shown, as escapes
    assert "\\x1b]52;c;" in inspect and "\\x9b31m\\x7f\\u202e" in inspect


def test_parents_of_the_cache_and_the_trace_are_private_under_umask_000(tmp_path):
    import os
    import stat

    from vllm_kvdisk.ops.trace import Trace

    old = os.umask(0)
    try:
        Store(str(tmp_path / "a" / "b" / "kv"), space_bytes=1 << 30).close()
        Trace(str(tmp_path / "t" / "u" / "trace.log"))
    finally:
        os.umask(old)
    for sub in ("a", "a/b", "a/b/kv", "t", "t/u"):
        assert stat.S_IMODE(os.stat(tmp_path / sub).st_mode) == 0o700, sub
    assert stat.S_IMODE(os.stat(tmp_path / "t/u/trace.log").st_mode) == 0o600


def test_verify_fix_reports_the_corrupt_file_it_moved(tmp_path, capsys):
    """A file whose header does not parse is quarantined by the writable scan: ``verify
    --fix`` says so (it used to scan twice, lose the first scan's finding and print
    ``0 problem(s), 0 fixed``, exit 0)."""
    import json
    import os

    from vllm_kvdisk.ops.cli import main

    store = Store(str(tmp_path / "kv"), space_bytes=1 << 30)
    ns = store.ensure_namespace(FP)
    plan, _ = save(store, ns, prompt(5), 112, np.random.default_rng(0))
    path = store.path(ns, plan.sha1)
    raw = bytearray(open(path, "rb").read())
    raw[0] ^= 1  # bad magic
    open(path, "wb").write(raw)
    assert main(["verify", store.root, "--fix"]) == 1
    out = capsys.readouterr().out
    assert f"{ns}/{plan.sha1}" in out and "(quarantined)" in out and "1 fixed" in out
    assert not os.path.exists(path) and len(store.quarantined_files()) == 1
    raw[0] ^= 1
    raw[-200] ^= 1  # a checksum that fails: found by the full read
    open(path, "wb").write(raw)
    assert main(["verify", store.root, "--fix", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["fixed"] == 1 and report["problems"][0]["fixed"] == "quarantined"
    assert main(["verify", store.root]) == 0
