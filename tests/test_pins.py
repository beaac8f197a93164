"""Pins (``kvdisk.pin_s``): ROOT/.pins read by every eviction, honoured within the pin
share, latest expiry first; a hostile pin file reads as no pins."""

import json

import numpy as np
from synth import make, prompt, save

from vllm_kvdisk.storage import pins
from vllm_kvdisk.storage.store import Store


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def two_sessions(tmp_path, clock):
    store, ns = make(tmp_path, clock=clock)
    rng = np.random.default_rng(0)
    a, _ = save(store, ns, prompt(1), 128, rng)
    b, _ = save(store, ns, prompt(2), 128, rng)
    return store, ns, a, b


def names(store: Store) -> set[str]:
    return {e.sha1 for e in store.index.entries()}


def test_a_pinned_file_survives_an_eviction_that_takes_every_other_until_it_expires(tmp_path):
    clock = Clock()
    store, ns, a, b = two_sessions(tmp_path, clock)
    store.pin([((ns, a.sha1), clock.now + 60)], share_bytes=1 << 30)
    assert store.pinned() == {(ns, a.sha1)}
    store.gc_to(0)
    assert names(store) == {a.sha1}
    # Another process (a `kvdisk gc`) reads the same pins from ROOT/.pins.
    other = Store(store.root, space_bytes=1 << 30, clock=clock)
    assert other.gc_to(0) == [] and names(other) == {a.sha1}
    clock.now += 61  # expired: an ordinary file again
    assert [e.sha1 for e in other.gc_to(0)] == [a.sha1]


def test_pins_past_their_share_are_not_honoured_latest_expiry_first(tmp_path):
    clock = Clock()
    store, ns, a, b = two_sessions(tmp_path, clock)
    size = store.index.get(ns, a.sha1).size
    store.pin([((ns, a.sha1), clock.now + 60), ((ns, b.sha1), clock.now + 30)], size)
    assert store.pinned() == {(ns, a.sha1)}  # room for one: the one pinned longest
    store.pin([((ns, b.sha1), clock.now + 90)], size)  # a later expiry wins
    assert store.pinned() == {(ns, b.sha1)}
    store.pin([], 0)  # a share of 0 honours nothing
    assert store.pinned() == set()


def test_a_hostile_or_foreign_pin_file_reads_as_no_pins(tmp_path):
    clock = Clock()
    store, ns, a, b = two_sessions(tmp_path, clock)
    key = [ns, a.sha1, clock.now + 60]
    for raw in (
        b"not json",
        b"[" * 100_000,
        json.dumps({"version": 2, "share": 1 << 30, "pins": [key]}).encode(),
        json.dumps({"version": 1, "share": -1, "pins": [key]}).encode(),
        json.dumps({"version": 1, "share": True, "pins": [key]}).encode(),
        json.dumps({"version": 1, "share": 1 << 30, "pins": [[ns, a.sha1, "later"]]}).encode(),
    ):
        with open(f"{store.root}/{pins.NAME}", "wb") as fh:
            fh.write(raw)
        assert store.pinned() == set(), raw[:40]
    assert len(store.gc_to(0)) == 2


def test_the_file_keeps_only_live_pins_and_at_most_its_cap():
    now = 1000.0
    raw = pins.encode({("n", "a"): now + 5, ("n", "b"): now - 1}, 7, now)
    assert pins.parse(raw) == ({("n", "a"): now + 5}, 7)
