"""Quarantine: a file proven corrupt is moved aside with a note, never indexed, and the
quarantine stays bounded."""

import os

import numpy as np
import pytest
from synth import make, prompt, save

from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify


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


def test_quarantine_stays_bounded(tmp_path):
    store, ns = make(tmp_path, quarantine_max_bytes=1)
    rng = np.random.default_rng(0)
    for i in range(3):
        plan, _ = save(store, ns, prompt(90 + i), 48, rng)
        store.quarantine(ns, plan.sha1, "checksum mismatch")
    assert len(store.quarantined_files()) <= 1 and store.stats.quarantined == 3
