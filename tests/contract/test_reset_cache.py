"""``reset_cache`` runs in the engine's step: it never waits there for ``ROOT/.lock``,
which another process may hold (another replica's save, ``kvdisk verify --fix``). Held by
a real ``flock`` of another process; checked by what happened while it was held, never by
durations."""

from __future__ import annotations

import os

import vllm_api as api
from driver import seed_checkpoint
from test_protocol import PROMPT

from vllm_kvdisk.testing.harness import hold_lock


def test_reset_cache_never_waits_for_the_lock_in_the_step(make_engine):
    """The lock was waited on for up to ``kv_disk_lock_timeout_s`` (10 s) inside the step,
    and a reset that timed out failed. Now the step returns at once while the lock is
    held; the namespace's lookups miss from then on, and a thread renames it away once the
    lock is free."""
    e = make_engine(1)
    seed_checkpoint(e, PROMPT, 160)
    side = e.kvdisk
    ns = side.store.namespaces()[0]
    r = api.make_request(PROMPT, max_tokens=4)
    assert side.get_num_new_matched_tokens(r, 0)[0] > 0  # a hit before the reset
    holder = hold_lock(side.store.root)
    try:
        assert side.reset_cache() is True
        assert holder.poll() is None  # returned while the other process holds the lock
        thread = side.resetter
        assert thread is not None and thread.is_alive()  # it waits for the lock
        assert os.path.isdir(side.store.ns_dir(ns))  # not renamed yet: the lock is busy
        assert side.get_num_new_matched_tokens(r, 0) == (0, False)  # a miss meanwhile
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()
    thread.join()
    assert not os.path.exists(side.store.ns_dir(ns))
    assert ns not in side.store.namespaces()
