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


def test_salt_digests_are_keyed_with_the_roots_secret(tmp_path):
    """namespace.json and the directory name say nothing about a guessed salt without
    ``ROOT/.salt-key`` (0600, made once); every replica of the root reads the same key, so
    a salt names the same namespace in all of them; unsalted namespaces keep their names."""
    import hashlib
    import json
    import os
    import stat
    import threading

    from vllm_kvdisk.core.keys import salt_digest

    root = str(tmp_path / "kv")
    stores: list[Store] = []
    barrier = threading.Barrier(4)

    def open_one() -> None:
        barrier.wait()
        stores.append(Store(root, space_bytes=1 << 30))

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    keys = {s.salt_key for s in stores}
    assert len(keys) == 1 and len(next(iter(keys))) == 32  # one key, whoever made it
    key_path = os.path.join(root, ".salt-key")
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
    replica = Store(root, space_bytes=1 << 30)
    assert replica.salt_key == stores[0].salt_key
    other_root = Store(str(tmp_path / "other"), space_bytes=1 << 30)
    assert other_root.salt_key != replica.salt_key

    salt = "tenant-guessable"
    unkeyed = hashlib.sha256(b"kvdisk-salt\0" + salt.encode()).hexdigest()[:32]
    digest = salt_digest(salt, key=replica.salt_key)
    assert digest != unkeyed and digest != salt_digest(salt, key=other_root.salt_key)
    ns = replica.ensure_namespace(FP.scoped("", digest))
    guessed = FP.scoped("", unkeyed)  # the offline guess of whoever reads the directory
    assert ns != guessed.dirname()
    raw = open(os.path.join(root, ns, "namespace.json"), "rb").read()
    assert unkeyed.encode() not in raw and json.loads(raw)["salt_keyed"] is True
    # unsalted namespaces: the name and namespace.json they always had
    plain = replica.ensure_namespace(FP)
    assert plain == FP.dirname() and "salt_keyed" not in replica.namespace_info(plain)


def test_a_salted_namespace_of_an_earlier_build_is_removed_at_start(tmp_path):
    """Its name came from the unkeyed digest: no lookup reaches it, and its namespace.json
    confirms a guessed salt offline. Unsalted and keyed namespaces stay."""
    import hashlib
    import json
    import os

    root = str(tmp_path / "kv")
    store = Store(root, space_bytes=1 << 30)
    unkeyed = hashlib.sha256(b"kvdisk-salt\0tenant").hexdigest()[:32]
    old = FP.scoped("", unkeyed)
    ns_old = store.ensure_namespace(old)
    path = os.path.join(root, ns_old, "namespace.json")
    info = json.load(open(path))
    del info["salt_keyed"]  # as an earlier build wrote it
    open(path, "w").write(json.dumps(info))
    save(store, ns_old, prompt(1), 112, np.random.default_rng(0))
    ns_plain = store.ensure_namespace(FP)
    ns_keyed = store.ensure_namespace(FP.scoped("", "c" * 32))
    fresh = Store(root, space_bytes=1 << 30)
    fresh.start(background=False)
    for t in fresh.removing:
        t.join()
    assert sorted(fresh.namespaces()) == sorted([ns_plain, ns_keyed])
    assert not [n for n in os.listdir(root) if n.startswith(".trash-")]


def test_a_salt_key_of_the_wrong_size_is_an_error_not_replaced(tmp_path):
    import pytest

    from vllm_kvdisk.storage.secret import BadSaltKey

    root = tmp_path / "kv"
    Store(str(root), space_bytes=1 << 30).close()
    (root / ".salt-key").write_bytes(b"short")
    with pytest.raises(BadSaltKey, match="5 bytes"):
        Store(str(root), space_bytes=1 << 30)
    assert (root / ".salt-key").read_bytes() == b"short"
    Store(str(root), space_bytes=1 << 30, readonly=True).close()  # the tools need no key


def _fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def test_400_salts_cost_a_bounded_number_of_descriptors(tmp_path):
    """Every namespace used to keep a descriptor open for the life of the process: 40
    salts added 40 descriptors to each process, 400 exhausted a low RLIMIT_NOFILE."""
    root = str(tmp_path / "kv")
    bound = 48  # 32 namespace descriptors at most, the root, lock, journal and a few more
    before = _fds()
    store = Store(root, space_bytes=1 << 30)
    rng = np.random.default_rng(0)
    p = prompt(2)
    names = []
    for i in range(400):
        ns = store.ensure_namespace(FP.scoped("", f"{i:032x}"))
        names.append(ns)
        if i % 40 == 0:
            save(store, ns, p, 48, rng)
    for ns in names:
        store.refresh(ns, force=True)
    assert store.peers("", f"{0:032x}")(names[0]) and not store.peers("", f"{0:032x}")(names[40])
    assert len(store.index) == 10
    assert _fds() - before <= bound
    fresh = Store(root, space_bytes=1 << 30)
    fresh.start(background=False)
    assert len(fresh.index) == 10 and _fds() - before <= 2 * bound


START_UNDER_A_LOW_LIMIT = """
import resource, socket, sys
sys.path.insert(0, {tests!r})
from vllm_kvdisk.storage.store import Store
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
store = Store({root!r}, space_bytes=1 << 30)
store.start(background=False)
for ns in store.namespaces():
    store.refresh(ns, force=True)
socket.socket().close()  # the process can still open sockets
print(len(store.namespaces()))
"""


def test_a_store_starts_on_400_empty_namespaces_under_a_low_descriptor_limit(tmp_path):
    import os
    import subprocess
    import sys

    root = str(tmp_path / "kv")
    store = Store(root, space_bytes=1 << 30)
    for i in range(400):
        store.ensure_namespace(FP.scoped("", f"{i:032x}"))
    store.close()
    code = START_UNDER_A_LOW_LIMIT.format(root=root, tests=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["400"]  # fresh: kept (a saver may be about to use one)


def test_empty_namespaces_are_removed_when_unchanged_for_a_while(tmp_path):
    import os

    root = str(tmp_path / "kv")
    store = Store(root, space_bytes=1 << 30)
    empty = [store.ensure_namespace(FP.scoped("", f"{i:032x}")) for i in range(5)]
    full = store.ensure_namespace(FP.scoped("", "f" * 32))
    save(store, full, prompt(6), 48, np.random.default_rng(0))
    old = os.stat(store.ns_dir(full)).st_mtime - 3600
    for ns in empty[:4] + [full]:
        os.utime(store.ns_dir(ns), (old, old))
    os.mkdir(os.path.join(store.ns_dir(empty[3]), "x"))  # not ours to judge: kept
    os.utime(store.ns_dir(empty[3]), (old, old))
    fresh = Store(root, space_bytes=1 << 30)
    fresh.start(background=False)
    assert sorted(fresh.namespaces()) == sorted([empty[3], empty[4], full])
    assert len(fresh.index) == 1
    assert not [n for n in os.listdir(root) if n.startswith(".trash-")]


def test_a_save_past_the_namespace_cap_is_skipped(tmp_path):
    import pytest

    from vllm_kvdisk.storage.budget import SaveSkipped

    store = Store(str(tmp_path / "kv"), space_bytes=1 << 30, max_namespaces=3)
    names = [store.ensure_namespace(FP.scoped("", f"{i:032x}")) for i in range(3)]
    assert store.ensure_namespace(FP.scoped("", f"{1:032x}")) == names[1]  # one it has
    with pytest.raises(SaveSkipped) as skipped:
        store.ensure_namespace(FP.scoped("", "e" * 32))
    assert skipped.value.reason == "namespace_cap" and len(store.namespaces()) == 3


def test_with_a_namespace_share_the_tenant_over_it_loses_its_own_files_first():
    from vllm_kvdisk.core.entry import Entry
    from vllm_kvdisk.core.eviction import plan_eviction
    from vllm_kvdisk.core.format import Reason
    from vllm_kvdisk.core.index import Index

    def entry(ns, sha1, last_used, size=100):
        return Entry(ns, sha1, 48, None, 0, Reason.COLD, 0, 0, last_used, size, 0, 0)

    idx = Index()
    idx.add(entry("quiet", "q-old", 1))  # the least recently used file of all
    idx.add(entry("quiet", "q-new", 2))
    for i in range(8):
        idx.add(entry("loud", f"l{i}", 10 + i))
    # without a share: least recently used first, whoever's
    assert [e.sha1 for e in plan_eviction(idx, 200, now=100)] == ["q-old", "q-new"]
    # a share of 300 bytes each: "loud" holds 800, so it pays, oldest first
    plan = plan_eviction(idx, 200, now=100, share_bytes=300)
    assert [e.sha1 for e in plan] == ["l0", "l1"]
    # down to its share, "loud" is back in the common order
    plan = plan_eviction(idx, 700, now=100, share_bytes=300)
    assert [e.sha1 for e in plan[:5]] == ["l0", "l1", "l2", "l3", "l4"]
    assert [e.sha1 for e in plan[5:]] == ["q-old", "q-new"]
    # the file being added counts: a namespace that it pushes over its share pays
    idx = Index()
    idx.add(entry("a", "a1", 1))
    idx.add(entry("b", "b1", 5))
    assert [e.sha1 for e in plan_eviction(idx, 100, now=100, share_bytes=150)] == ["a1"]
    adding = [entry("b", "b2", 50)]
    plan = plan_eviction(idx, 100, now=100, adding=adding, share_bytes=150)
    assert [e.sha1 for e in plan] == ["b1"]


def test_a_store_with_a_namespace_share_keeps_the_quiet_tenants_files(tmp_path):
    """One tenant saving without end used to evict every other tenant's checkpoints (one
    global least-recently-used order); with a 50% share its own go first."""
    quiet_fp, loud_fp = FP.scoped("", "a" * 32), FP.scoped("", "b" * 32)
    probe = Store(str(tmp_path / "probe"), space_bytes=1 << 30)
    ns = probe.ensure_namespace(FP)
    one = save(probe, ns, prompt(0), 48, np.random.default_rng(0))[0]
    size = probe.index.get(ns, one.sha1).size
    for share, quiet_kept in ((0, 0), (50, 3)):
        store = Store(
            str(tmp_path / f"kv{share}"), space_bytes=10 * size, namespace_share_pct=share
        )
        quiet, loud = store.ensure_namespace(quiet_fp), store.ensure_namespace(loud_fp)
        rng = np.random.default_rng(0)
        for i in range(3):
            save(store, quiet, prompt(100 + i), 48, rng, now=1_000 + i)
        for i in range(20):
            save(store, loud, prompt(200 + i), 48, rng, now=2_000 + i)
        assert len(store.index.namespace_entries(quiet)) == quiet_kept, share
        assert store.index.total_bytes <= store.space_bytes


def test_kvdisk_gc_removes_empty_namespaces(tmp_path, capsys):
    import json
    import os

    from vllm_kvdisk.ops.cli import main

    store = Store(str(tmp_path / "kv"), space_bytes=1 << 30)
    names = [store.ensure_namespace(FP.scoped("", f"{i:032x}")) for i in range(3)]
    old = os.stat(store.root).st_mtime - 3600
    for ns in names[:2]:
        os.utime(store.ns_dir(ns), (old, old))
    assert main(["gc", store.root, "--to-mb", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["empty_namespaces_removed"] == 2
    assert store.namespaces() == [names[2]]


def test_a_start_while_another_replica_holds_the_lock_leaves_the_tidying_for_later(tmp_path):
    import os

    root = str(tmp_path / "kv")
    holder = Store(root, space_bytes=1 << 30)
    ns = holder.ensure_namespace(FP.scoped("", "a" * 32))
    old = os.stat(root).st_mtime - 3600
    os.utime(holder.ns_dir(ns), (old, old))
    with holder.lock.hold():
        fresh = Store(root, space_bytes=1 << 30, lock_timeout_s=0.2)
        fresh.start(background=False)  # no LockTimeout out of the start
        assert fresh.namespaces() == [ns]
    fresh.start(background=False)
    assert fresh.namespaces() == []
