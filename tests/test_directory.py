"""The directory: symlinks never followed, a shared root refused unless allowed, temp
files of dead writers removed after the grace (live ones never), a namespace removed
while readers hold its files."""

import os

import numpy as np
import pytest
from synth import FP, make, prompt, save

from vllm_kvdisk.storage.pageread import read_layer_into
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify


def test_symlinks_in_the_directory_are_never_followed(tmp_path):
    store, ns = make(tmp_path)
    rng = np.random.default_rng(0)
    plan, _ = save(store, ns, prompt(70), 48, rng)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.bin"
    victim.write_bytes(b"\0" * 4096)
    # 1. a .kv name that is a symlink: never indexed, touch() never writes through it
    link = os.path.join(store.ns_dir(ns), "f" * 40 + ".kv")
    os.symlink(victim, link)
    # 2. a namespace directory that is a symlink to someone else's files
    os.symlink(outside, os.path.join(store.root, "0123456789abcdef"))
    (outside / ("e" * 40 + ".kv")).write_bytes(open(store.path(ns, plan.sha1), "rb").read())
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()
    assert {e.sha1 for e in fresh.index.entries()} == {plan.sha1}
    fresh.touch(ns, "f" * 40)
    fresh.gc_to(0)
    assert victim.read_bytes() == b"\0" * 4096 and (outside / ("e" * 40 + ".kv")).exists()
    # 3. a quarantine that is a symlink: a bad file is deleted in place, never moved out
    os.symlink(outside, os.path.join(store.root, "quarantine"))
    bad, _ = save(store, ns, prompt(71), 48, rng)
    store.quarantine(ns, bad.sha1, "checksum mismatch")
    assert not os.path.exists(store.path(ns, bad.sha1))
    assert sorted(os.listdir(outside)) == ["e" * 40 + ".kv", "victim.bin"]
    # 4. a lock file that is a symlink: the lock is refused (a skipped save), never opened
    os.symlink(victim, os.path.join(store.root, ".lock.new"))
    os.replace(os.path.join(store.root, ".lock.new"), os.path.join(store.root, ".lock"))
    with pytest.raises(OSError):
        store.evict(1)
    assert victim.read_bytes() == b"\0" * 4096


def test_a_root_others_can_write_is_refused_unless_allowed(tmp_path):
    from vllm_kvdisk.storage.fsdir import UnsafeDirectory

    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeDirectory, match="writable by its group or by everyone"):
        Store(str(root), space_bytes=1 << 30)
    Store(str(root), space_bytes=1 << 30, allow_shared_dir=True)  # an explicit choice
    Store(str(root), space_bytes=1 << 30, readonly=True)  # inspection tools may look


def test_temp_files_dead_writers_go_after_the_grace_live_writers_never(tmp_path):
    import fcntl

    store, ns = make(tmp_path)
    d = store.ns_dir(ns)
    dead = os.path.join(d, ".tmp-" + "a" * 40 + ".kv-1-dead")
    live = os.path.join(d, ".tmp-" + "b" * 40 + ".kv-2-live")
    for path in (dead, live):
        with open(path, "wb") as fh:
            fh.write(b"x" * 1000)
        os.utime(path, (0, 0))  # older than the grace period
    holder = os.open(live, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a writer in another process, still writing
    try:
        report = verify(Store(store.root, space_bytes=1 << 30))  # --fix
        assert report.writing == 1
        assert not os.path.exists(dead) and os.path.exists(live)
    finally:
        os.close(holder)
    # Just made and not locked yet: within the grace its writer may still be about to lock it.
    young = os.path.join(d, ".tmp-" + "c" * 40 + ".kv-3-young")
    with open(young, "wb") as fh:
        fh.write(b"x" * 1000)
    Store(store.root, space_bytes=1 << 30).scan()
    assert os.path.exists(young)


def test_remove_namespace_leaves_readers_a_miss(tmp_path):
    store, ns = make(tmp_path)
    plan, layers = save(store, ns, prompt(95), 48, np.random.default_rng(0))
    with store.open(ns, plan.sha1) as (fd, meta, _):
        assert Store(store.root, space_bytes=1 << 30).remove_namespace(ns) == 1
        buf = bytearray(meta.offsets.layer_bytes)
        read_layer_into(fd, meta, 0, memoryview(buf))  # an open reader finishes its read
        assert bytes(buf) == layers[0]
    store.refresh(ns)
    assert len(store.index) == 0 and not os.path.exists(store.ns_dir(ns))
    assert (
        save(store, ns := store.ensure_namespace(FP), prompt(95), 48, np.random.default_rng(0))[
            0
        ].parent
        is None
    )
