"""The index's invariants, by property: random sequences of save / forget / load failure
/ quarantine / evict / compact / restart over two stores of one cache directory (two
replicas), checked after every step:

* a store whose index is whole (after the catch-up every save makes, always reached)
  knows every checkpoint name on disk, in its index or as known bad, and each indexed
  entry is the file under its name (inode, size, mtime) with what its header says;
* every removal is counted and journaled: the other store, following the journal only,
  agrees with the disk;
* an unreadable file never makes its parent a leaf: no eviction leaves an orphan;
* the checkpoint bytes on disk stay within the budget both stores keep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import tempfile
from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.synth import FP, prompt, save
from vllm_kvdisk.storage import fileread
from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.directory import KV_NAME
from vllm_kvdisk.storage.quarantine import DIRNAME
from vllm_kvdisk.storage.store import Store

SPACE = 100_000  # about six files: saves evict
LENGTHS = (48, 112, 176)  # a root and two deltas on it


def on_disk(root: str) -> dict[tuple[str, str], os.stat_result]:
    found = {}
    for ns in os.listdir(root):
        path = os.path.join(root, ns)
        if ns == DIRNAME or not os.path.isdir(path) or os.path.islink(path):
            continue
        for name in os.listdir(path):
            if KV_NAME.match(name):
                found[(ns, name[:40])] = os.stat(os.path.join(path, name))
    return found


def headers(root: str) -> dict[tuple[str, str], tuple]:
    fresh = Store(root, space_bytes=1 << 30)
    fresh.scan()
    try:
        return {e.key: (e.tokens, e.parent, e.parent_tokens) for e in fresh.index.entries()}
    finally:
        fresh.close()


def known_bad(store: Store) -> set[tuple[str, str]]:
    views = store.scanner._views.items()
    return {(ns, sha1) for ns, view in views for sha1 in getattr(view, "bad", ())}


def aged(root: str, stamps: dict[str, int]) -> None:
    """Give each namespace directory changed since the last call a new mtime, seconds
    in the past: a refresh trusts an mtime only once it is older than a timestamp tick
    (``fsdir.racy``), and these steps take microseconds. An unchanged directory keeps
    its mtime, as it would on disk."""
    for ns in os.listdir(root):
        path = os.path.join(root, ns)
        if ns == DIRNAME or not os.path.isdir(path) or os.path.islink(path):
            continue
        if os.stat(path).st_mtime_ns != stamps.get(ns):
            stamps[ns] = 1_000_000_000_000_000_000 + len(stamps) * 10**12 + stamps.get("n", 0)
            stamps["n"] = stamps.get("n", 0) + 10**9
            os.utime(path, ns=(stamps[ns], stamps[ns]))


def caught_up(store: Store) -> None:
    with store.lock.hold(), store._mutex:
        store.scanner.catch_up()


saves = st.tuples(
    st.just("save"),
    st.integers(0, 1),
    st.integers(0, 1),
    st.integers(0, 3),
    st.sampled_from(LENGTHS),
)
ops = st.one_of(
    saves,
    saves,
    saves,
    saves,
    saves,
    st.tuples(st.just("forget"), st.integers(0, 1), st.integers(0, 20)),
    st.tuples(st.just("load_failure"), st.integers(0, 1), st.integers(0, 20)),
    st.tuples(st.just("heal")),
    st.tuples(st.just("quarantine"), st.integers(0, 1), st.integers(0, 20)),
    st.tuples(st.just("evict"), st.integers(0, 1), st.integers(1, 30_000)),
    st.tuples(st.just("compact"), st.integers(0, 1)),
    st.tuples(st.just("restart"), st.integers(0, 1)),
)


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(steps=st.lists(ops, min_size=15, max_size=40))
def test_the_index_never_lies_about_the_disk(steps):
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = os.path.join(tmp, "cache")
        broken: set[int] = set()  # inodes whose reads fail (EIO)
        real_summary = fileread.read_summary

        def read_summary(fd, size):
            if os.fstat(fd).st_ino in broken:
                raise OSError(errno.EIO, "I/O error")
            return real_summary(fd, size)

        stack.enter_context(mock.patch.object(fileread, "read_summary", read_summary))
        stores = [Store(root, space_bytes=SPACE)]
        spaces = [
            stores[0].ensure_namespace(FP),
            stores[0].ensure_namespace(dataclasses.replace(FP, model="other")),
        ]
        stores.append(Store(root, space_bytes=SPACE))
        for store in stores:
            store.start(background=False)
        rng = np.random.default_rng(0)
        quarantined: set[str] = set()
        stamps: dict[str, int] = {}
        for step in steps:
            aged(root, stamps)
            kind = step[0]
            names = sorted(on_disk(root))
            if kind == "save":
                _, s, n, seed, length = step
                with contextlib.suppress(SaveSkipped, ValueError):
                    save(stores[s], spaces[n], prompt(seed, vocab=256), length, rng)
            elif kind in ("forget", "load_failure", "quarantine") and names:
                _, s, k = step
                ns, sha1 = names[k % len(names)]
                if kind == "load_failure":
                    broken.add(os.stat(stores[s].path(ns, sha1)).st_ino)
                if kind == "quarantine":
                    if stores[s].quarantine(ns, sha1, "proven corrupt"):
                        quarantined.add(sha1)
                else:
                    stores[s].forget(ns, sha1)
            elif kind == "heal":
                broken.clear()
            elif kind == "evict":
                stores[step[1]].evict(step[2])
            elif kind == "compact":
                stores[step[1]].scanner.write_snapshot(1.0)
            elif kind == "restart":
                s = step[1]
                stores[s].close()
                stores[s] = Store(root, space_bytes=SPACE)
                stores[s].start(background=False)
            disk = on_disk(root)
            # the budget both stores keep
            assert sum(st.st_size for st in disk.values()) <= SPACE
            # no eviction leaves an orphan (a quarantined parent may: proven corrupt)
            truth = headers(root)
            for key, (_, parent, _) in truth.items():
                if parent is not None and (key[0], parent) not in disk:
                    assert parent in quarantined, f"orphan {key} after {step}"
            for store in stores:
                caught_up(store)
                assert store.scanner.journaled(), f"never whole again after {step}"
                known = {e.key for e in store.index.entries()}
                assert known | known_bad(store) >= set(disk), f"a name unknown after {step}"
                assert known <= set(disk), f"a name gone still indexed after {step}"
                for entry in store.index.entries():
                    st_ = disk[entry.key]
                    assert (entry.inode, entry.size, entry.mtime_ns) == (
                        st_.st_ino,
                        st_.st_size,
                        st_.st_mtime_ns,
                    ), f"stale identity after {step}"
                    if entry.key in truth:
                        assert truth[entry.key] == (
                            entry.tokens,
                            entry.parent,
                            entry.parent_tokens,
                        ), f"stale header after {step}"
        for store in stores:
            store.close()
