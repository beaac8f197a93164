"""The store as its callers see it: files written atomically and read back, a rebuild
from headers alone, hit counts kept in place, readers unharmed by deletions."""

import os
import stat

import numpy as np
from synth import BLOCK, make, planner, prompt, save

from vllm_kvdisk.storage.pageread import read_layer_into
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify


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
            assert fh.read(3) == b"KVC"
    assert not [n for n in os.listdir(store.ns_dir(ns)) if n.startswith(".tmp-")]
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()
    assert len(fresh.index) == 3 and fresh.index.total_bytes == store.index.total_bytes
    hit = planner(fresh).lookup(ns, p.ids, 399)
    assert [e.tokens for e in hit.chain] == [48, 112, 240]
    for e in hit.chain:  # the chain's pages are exactly the pages written
        plan, layers = written[e.sha1]
        with fresh.open(ns, e.sha1) as (fd, meta, _):
            assert meta.payload.first_block * BLOCK == plan.parent_tokens
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
