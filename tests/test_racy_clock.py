"""A directory's mtime is trusted (not listed again while it is unchanged) only once it
is older than a timestamp tick, judged by the clock that stamped it: the file system's.
This host's clock used to be the judge: one running ahead of the file server's made a
change of the same tick look old, and a later change in that tick was never listed."""

import os
import time

import numpy as np
from synth import FP, prompt, save

from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage import scan as scan_module
from vllm_kvdisk.storage.store import Store

HOUR_NS = 3600 * 10**9


def test_a_replica_whose_clock_runs_ahead_still_lists_a_change_of_the_same_tick(
    tmp_path, monkeypatch
):
    """Replica B's clock is an hour ahead of the file system's. A saves a file, B lists
    the namespace at once, A saves another file in the same timestamp tick (the file
    system's tick made coarse here, ten minutes, so no stall of this test reaches its
    end; the second change then leaves the directory's mtime where it was)."""
    monkeypatch.setattr(fsdir, "RACY_NS", 600 * 10**9)
    real_time_ns = time.time_ns
    monkeypatch.setattr(scan_module.time, "time_ns", lambda: real_time_ns() + HOUR_NS)
    a = Store(str(tmp_path / "cache"), space_bytes=1 << 30)
    ns = a.ensure_namespace(FP)
    b = Store(a.root, space_bytes=1 << 30)
    rng = np.random.default_rng(0)
    first, _ = save(a, ns, prompt(1, vocab=256), 48, rng)
    directory = a.ns_dir(ns)
    os.utime(directory)  # stamped by the file system's clock, now
    stamp = os.stat(directory).st_mtime_ns
    b.refresh(ns)
    assert b.index.get(ns, first.sha1) is not None
    second, _ = save(a, ns, prompt(2, vocab=256), 48, rng)
    os.utime(directory, ns=(stamp, stamp))  # the same tick: the mtime did not move
    b.refresh(ns)
    assert b.index.get(ns, second.sha1) is not None  # listed again, not trusted


def test_a_directory_older_than_a_tick_is_still_trusted(tmp_path):
    """The file system's clock says an mtime an hour old is old: an unchanged directory
    is not listed again (one stat per refresh)."""
    a = Store(str(tmp_path / "cache"), space_bytes=1 << 30)
    ns = a.ensure_namespace(FP)
    save(a, ns, prompt(1, vocab=256), 48, np.random.default_rng(0))
    old = time.time_ns() - HOUR_NS
    os.utime(a.ns_dir(ns), ns=(old, old))
    b = Store(a.root, space_bytes=1 << 30)
    assert b.refresh(ns) is True  # listed
    assert b.refresh(ns) is False  # trusted: one stat


def test_without_the_file_systems_clock_nothing_is_trusted(tmp_path):
    """A ``.clock`` that is not a regular file (planted): no time to judge by, so every
    refresh lists; never an error."""
    a = Store(str(tmp_path / "cache"), space_bytes=1 << 30)
    ns = a.ensure_namespace(FP)
    save(a, ns, prompt(1, vocab=256), 48, np.random.default_rng(0))
    old = time.time_ns() - HOUR_NS
    os.utime(a.ns_dir(ns), ns=(old, old))
    clock = os.path.join(a.root, ".clock")
    if os.path.exists(clock):
        os.unlink(clock)
    os.mkfifo(clock)
    b = Store(a.root, space_bytes=1 << 30)
    assert b.directory.now_ns() is None
    assert b.refresh(ns) is True
    assert b.refresh(ns) is True  # listed again
    assert len(b.index) == 1
