"""Quarantine: a file proven corrupt is moved aside with a note, never indexed, and the
quarantine stays bounded."""

import os

import numpy as np
import pytest
from synth import FP, encode, make, pages, planner, prompt, save

from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.storage.budget import SaveSkipped
from vllm_kvdisk.storage.quarantine import DIRNAME
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


def test_a_quarantined_files_descendants_leave_and_their_prefixes_can_be_saved(tmp_path):
    """A corrupt root under a sound delta: the delta is unreachable once the root is
    quarantined, and its name (the SHA1 of the very text a save of that prefix writes)
    used to stay on disk, refusing that save as ``exists`` on every turn and after every
    restart. The quarantine takes the file's descendants with it, says which, and the
    prefix is saved again (as a root now); another chain is untouched."""
    dropped = []
    store = Store(
        str(tmp_path / "cache"), space_bytes=1 << 30, on_drop=lambda e, why: dropped.append(e)
    )
    ns = store.ensure_namespace(FP)
    p, other = prompt(1), prompt(2)
    rng = np.random.default_rng(0)
    root, _ = save(store, ns, p, 48, rng)
    delta, _ = save(store, ns, p, 112, rng)
    deeper, _ = save(store, ns, p, 176, rng)
    kept, _ = save(store, ns, other, 48, rng)
    assert (delta.parent, deeper.parent) == (root.sha1, delta.sha1)
    path = store.path(ns, root.sha1)
    fd = os.open(path, os.O_RDONLY)  # the descriptor that proved it corrupt
    try:
        st = os.fstat(fd)
        assert store.quarantine(ns, root.sha1, "checksum", inode=st.st_ino, dev=st.st_dev)
    finally:
        os.close(fd)
    assert [e.sha1 for e in dropped] == [delta.sha1, deeper.sha1]
    for gone in (root, delta, deeper):
        assert store.index.get(ns, gone.sha1) is None
        assert not os.path.exists(store.path(ns, gone.sha1))
    assert store.index.get(ns, kept.sha1) and os.path.exists(store.path(ns, kept.sha1))
    assert os.listdir(os.path.join(store.root, DIRNAME)) != []
    # Another replica following the journal forgets them too.
    other_store = Store(store.root, space_bytes=1 << 30)
    assert other_store.start(background=False)
    assert {e.sha1 for e in other_store.index.entries()} == {kept.sha1}
    # The prefix the delta held is saved again, under the same name, as a root.
    plan = planner(store).plan_save(ns, p, 112, Reason.COLD)
    assert (plan.sha1, plan.parent) == (delta.sha1, None)
    store.write(ns, plan.sha1, encode(plan, p, pages(rng, plan)))
    assert verify(Store(store.root, space_bytes=1 << 30, readonly=True)).ok


def test_an_orphans_name_is_saved_again(tmp_path):
    """A delta whose root left without it (deleted by hand, or quarantined by a scan that
    indexed the delta after it): nothing can load it, and its name is the one a save of
    its prefix writes. The save used to be refused (``exists``, or not even reserved) on
    every turn and after every restart; now the orphan and its own descendants go and the
    save takes the name, as a root."""
    store, ns = make(tmp_path)
    p = prompt(4)
    rng = np.random.default_rng(0)
    root, _ = save(store, ns, p, 48, rng)
    delta, _ = save(store, ns, p, 112, rng)
    deeper, _ = save(store, ns, p, 176, rng)
    os.unlink(store.path(ns, root.sha1))
    restarted = Store(store.root, space_bytes=1 << 30)
    restarted.scan()
    assert {e.sha1 for e in restarted.index.orphans()} == {delta.sha1, deeper.sha1}
    plan = planner(restarted).plan_save(ns, p, 112, Reason.COLD)
    assert (plan.sha1, plan.parent) == (delta.sha1, None)
    assert planner(restarted).reserve(plan, p, 0)
    restarted.write(ns, plan.sha1, encode(plan, p, pages(rng, plan)))
    assert restarted.index.get(ns, delta.sha1).parent is None
    assert not os.path.exists(restarted.path(ns, deeper.sha1))
    assert verify(Store(store.root, space_bytes=1 << 30, readonly=True)).ok
    # A sound file keeps its name: the same save again is refused.
    with pytest.raises(SaveSkipped, match="exists"):
        restarted.write(ns, plan.sha1, encode(plan, p, pages(rng, plan)))


def test_a_name_whose_missing_parent_is_on_disk_is_not_taken_over(tmp_path):
    """An entry whose parent the index lacks may have a parent on disk that cannot be read
    right now: the name is kept, the save skipped."""
    store, ns = make(tmp_path)
    p = prompt(5)
    rng = np.random.default_rng(0)
    root, _ = save(store, ns, p, 48, rng)
    delta, _ = save(store, ns, p, 112, rng)
    store.index.remove(ns, root.sha1)  # unread, still on disk
    plan = planner(store).plan_save(ns, p, 112, Reason.COLD)
    with pytest.raises(SaveSkipped, match="exists"):
        store.write(ns, plan.sha1, encode(plan, p, pages(rng, plan)))
    assert os.path.exists(store.path(ns, delta.sha1))


def test_verify_fix_reports_the_descendants_a_quarantine_takes(tmp_path):
    """``kvdisk verify --fix`` on a corrupt root under a delta: the root is quarantined,
    the delta deleted with it, and the report names both (bad, orphan), as it did when
    the orphan pass found the delta after."""
    store, ns = make(tmp_path)
    p = prompt(6)
    rng = np.random.default_rng(0)
    root, _ = save(store, ns, p, 48, rng)
    delta, _ = save(store, ns, p, 112, rng)
    with open(store.path(ns, root.sha1), "r+b") as fh:
        fh.seek(-100, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-100, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0x40]))
    report = verify(Store(store.root, space_bytes=1 << 30))
    assert sorted((p.kind, p.sha1) for p in report.problems) == sorted(
        [("bad", root.sha1), ("orphan", delta.sha1)]
    )
    assert report.fixed == 2 and not os.path.exists(store.path(ns, delta.sha1))
    assert verify(Store(store.root, space_bytes=1 << 30)).ok
