"""The directory: atomic files, rebuild from headers, quarantine, budget, two processes."""

import multiprocessing as mp
import os
import stat
from types import SimpleNamespace

import numpy as np
import pytest

from synth import FP, GRID, byte_table, save
from vllm_kvdisk.format import read_layer_into
from vllm_kvdisk.planner import Planner, Prompt
from vllm_kvdisk.store import Store
from vllm_kvdisk.verify import verify


def make(tmp_path, **kw):
    kw.setdefault("space_bytes", 1 << 30)
    store = Store(str(tmp_path / "cache"), **kw)
    return store, store.ensure_namespace(FP)


def prompt(seed=0, n=400):
    return Prompt(byte_table(), GRID, np.random.default_rng(seed).integers(0, 262, n))


def test_files_permissions_and_rebuild_from_headers(tmp_path):
    store, ns = make(tmp_path)
    p = prompt()
    rng = np.random.default_rng(0)
    written = {}
    for length in (48, 112, 240):
        plan, layers = save(store, ns, p, length, rng)
        written[plan.sha1] = (plan, layers)
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.ns_dir(ns)).st_mode) == 0o700
    for sha1 in written:
        assert stat.S_IMODE(os.stat(store.path(ns, sha1)).st_mode) == 0o600
        with open(store.path(ns, sha1), "rb") as fh:
            head = fh.read(200)
        assert head[:3] == b"KVC"
    assert not [n for n in os.listdir(store.ns_dir(ns)) if n.startswith(".tmp-")]
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()
    assert len(fresh.index) == 3 and fresh.index.total_bytes == store.index.total_bytes
    hit = Planner(fresh.index, GRID).lookup(ns, p, 399)
    assert [e.tokens for e in hit.chain] == [48, 112, 240]
    # The chain's pages are exactly the pages written (byte identity, block ranges).
    for e in hit.chain:
        plan, layers = written[e.sha1]
        with fresh.open(ns, e.sha1) as (fd, meta, _):
            assert meta.payload.first_block * 16 == plan.parent_tokens
            for i, want in enumerate(layers):
                buf = bytearray(meta.offsets.layer_bytes)
                read_layer_into(fd, meta, i, memoryview(buf))
                assert bytes(buf) == want
    assert verify(fresh).ok


def test_hit_count_and_last_use_update_in_place(tmp_path):
    now = [1000.0]
    store, ns = make(tmp_path, clock=lambda: now[0])
    plan, _ = save(store, ns, prompt(), 48, np.random.default_rng(0), now=1000)
    now[0] = 5000
    store.touch(ns, plan.sha1)
    store.touch(ns, plan.sha1)
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()
    e = fresh.index.get(ns, plan.sha1)
    assert (e.hits, e.last_used, e.created) == (2, 5000, 1000)
    assert verify(fresh).ok  # header stats are outside the checksums by design


@pytest.mark.parametrize("damage", ["truncate", "flip_page", "garbage", "empty", "foreign_text"])
def test_bad_files_are_quarantined_and_never_indexed(tmp_path, damage):
    store, ns = make(tmp_path)
    p = prompt()
    rng = np.random.default_rng(0)
    good, _ = save(store, ns, p, 48, rng)
    bad, _ = save(store, ns, p, 112, rng)
    path = store.path(ns, bad.sha1)
    raw = bytearray(open(path, "rb").read())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip_page":
        raw[-100] ^= 0x40
    elif damage == "garbage":
        raw = bytearray(os.urandom(len(raw)))
    elif damage == "empty":
        raw = bytearray()
    else:
        raw[60] ^= 0x01  # the text no longer hashes to the file name
    open(path, "wb").write(bytes(raw))
    fresh = Store(store.root, space_bytes=1 << 30)
    report = verify(fresh)  # a writable store repairs: quarantine
    assert not report.ok and report.problems[0].sha1 == bad.sha1
    assert fresh.index.get(ns, bad.sha1) is None and fresh.index.get(ns, good.sha1)
    assert not os.path.exists(path)
    assert len(fresh.quarantined_files()) == 1
    assert verify(fresh).ok  # nothing left to complain about


def test_budget_evicts_leaves_and_never_the_file_just_written(tmp_path):
    now = [0.0]
    store, ns = make(tmp_path, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    a = prompt(1)
    plan_a, _ = save(store, ns, a, 48, rng)
    size = store.index.get(ns, plan_a.sha1).size
    store.space_bytes = int(size * 2.5)
    plan_b, _ = save(store, ns, prompt(2), 48, rng)
    now[0] = 10
    plan_c, _ = save(store, ns, prompt(3), 48, rng)  # over budget: the oldest leaf goes
    names = {e.sha1 for e in store.index.entries()}
    assert names == {plan_b.sha1, plan_c.sha1}
    assert not os.path.exists(store.path(ns, plan_a.sha1))
    store.space_bytes = 1  # absurd budget: still never evicts the file just written
    plan_d, _ = save(store, ns, prompt(4), 48, rng)
    assert {e.sha1 for e in store.index.entries()} == {plan_d.sha1}
    assert store.stats.evicted == 3


def test_parent_is_kept_while_children_exist(tmp_path):
    store, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    p = prompt()
    root, _ = save(store, ns, p, 48, rng)
    child, _ = save(store, ns, p, 112, rng)
    evicted = store.evict(1)
    assert [e.sha1 for e in evicted] == [child.sha1]
    assert store.index.get(ns, root.sha1) is not None


def test_free_space_watermark(tmp_path):
    free = [10 << 20]
    fake = lambda path: SimpleNamespace(f_bavail=free[0] // 4096, f_frsize=4096)
    store, ns = make(tmp_path, statvfs=fake, min_free_bytes=9 << 20)
    rng = np.random.default_rng(0)
    first, _ = save(store, ns, prompt(1), 48, rng)
    free[0] = (9 << 20) + 100  # the next write would cross the watermark
    second, _ = save(store, ns, prompt(2), 48, rng)
    assert {e.sha1 for e in store.index.entries()} == {second.sha1}


def _writer(root, seed, count, queue):
    store = Store(root, space_bytes=1 << 30)
    ns = store.ensure_namespace(FP)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        plan, _ = save(store, ns, prompt(seed * 100 + i), 112, rng)
        out.append(plan.sha1)
    queue.put(out)


def test_two_processes_write_one_directory_and_a_reader_sees_them(tmp_path):
    root = str(tmp_path / "cache")
    reader = Store(root, space_bytes=1 << 30)
    ns = reader.ensure_namespace(FP)
    reader.scan()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(root, s, 5, queue)) for s in (1, 2)]
    for proc in procs:
        proc.start()
    names = set(queue.get(timeout=60)) | set(queue.get(timeout=60))
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert reader.refresh(ns)
    assert {e.sha1 for e in reader.index.entries()} >= names and len(names) == 10
    assert verify(reader).ok
    for sha1 in list(names)[:3]:
        os.unlink(reader.path(ns, sha1))
    reader.refresh(ns)
    assert len(reader.index) == 7


def test_open_reader_survives_concurrent_eviction(tmp_path):
    store, ns = make(tmp_path)
    plan, layers = save(store, ns, prompt(), 48, np.random.default_rng(0))
    with store.open(ns, plan.sha1) as (fd, meta, _):
        other = Store(store.root, space_bytes=1 << 30)
        other.scan()
        other.gc_to(0)  # another process evicts everything
        assert not os.path.exists(store.path(ns, plan.sha1))
        buf = bytearray(meta.offsets.layer_bytes)
        read_layer_into(fd, meta, 0, memoryview(buf))
        assert bytes(buf) == layers[0]
