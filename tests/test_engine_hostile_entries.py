"""A real engine with hostile entries planted in its cache directory: FIFOs, a socket, a
device node and a directory named like its files, a FIFO in place of one of its
checkpoints, and foreign namespaces whose namespace.json is a FIFO, 1e400 or nested
deeper than the json module can parse. The server keeps answering exactly and keeps
saving (and evicting) new checkpoints. Unit-level cases: test_hostile_entries.py."""

from __future__ import annotations

import glob
import os
import socket
import stat

import numpy as np
import pytest
from engine import engine, generate, random_prompt, wait_until
from synth import FP, prompt, save

from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

FOREIGN = {
    "f00dfeedf00dfeed": b"[" * 100_000 + b"]" * 100_000,
    "0badc0de0badc0de": b'{"tp_size": 1e400, "model": "tiny"}',
    "decafbaddecafbad": None,
}  # a FIFO


def plant_foreign(kv: str, scratch: str) -> None:
    """Namespaces of another engine, each with one sound checkpoint (a leaf every eviction
    may choose, so every eviction reads their namespace.json) and a hostile description."""
    for i, (name, info) in enumerate(FOREIGN.items()):
        other = Store(scratch, space_bytes=1 << 30)
        ns = other.ensure_namespace(FP)
        plan, _ = save(other, ns, prompt(i, 100), 48, np.random.default_rng(i))
        os.makedirs(os.path.join(kv, name), mode=0o700)
        os.rename(other.path(ns, plan.sha1), os.path.join(kv, name, f"{plan.sha1}.kv"))
        other.close()
        path = os.path.join(kv, name, "namespace.json")
        if info is None:
            os.mkfifo(path, 0o600)
        else:
            with open(path, "wb") as fh:
                fh.write(info)


def plant_specials(ns_dir: str, victim: str) -> None:
    """In the engine's own namespace: an abandoned-looking temp FIFO (the scan asks whether
    its writer is gone), a socket, a device node and a directory named like checkpoints,
    and a FIFO renamed over one of its files."""
    tmp = os.path.join(ns_dir, ".tmp-" + "a" * 40 + ".kv-1-dead")
    os.mkfifo(tmp, 0o600)
    os.utime(tmp, (0, 0), follow_symlinks=False)
    here = os.getcwd()
    os.chdir(ns_dir)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("b" * 40 + ".kv")
        sock.close()
    finally:
        os.chdir(here)
    os.mknod(os.path.join(ns_dir, "c" * 40 + ".kv"), stat.S_IFCHR | 0o600, os.makedev(1, 3))
    os.mkdir(os.path.join(ns_dir, "d" * 40 + ".kv"), 0o700)
    fifo = victim + ".fifo"
    os.mkfifo(fifo, 0o600)
    os.rename(fifo, victim)


def regular_kv(ns_dir: str) -> set[str]:
    return {
        os.path.basename(p)
        for p in glob.glob(os.path.join(ns_dir, "*.kv"))
        if stat.S_ISREG(os.lstat(p).st_mode)
    }


def test_hostile_entries_never_stop_the_server_answering_or_saving(tiny_model, tmp_path):
    kv = str(tmp_path / "kv")
    os.makedirs(kv, mode=0o700)
    plant_foreign(kv, str(tmp_path / "scratch"))
    prompts = [random_prompt(1000, seed=90 + i) for i in range(4)]
    # Each conversation takes ~4 MiB: with 6 MiB every new one must evict.
    with engine(
        tiny_model, kv, prefix_caching=False, kv_disk_space_mb=6, kv_disk_min_free_mb=0
    ) as llm:
        # A first answer is computed: nothing on disk shares its prefix (the reference).
        reference, _ = generate(llm, prompts[0])
        (ns_dir,) = [
            d
            for d in glob.glob(os.path.join(kv, "[0-9a-f]" * 16))
            if os.path.basename(d) not in FOREIGN
        ]
        ours = regular_kv(ns_dir)
        assert ours
        plant_specials(ns_dir, os.path.join(ns_dir, sorted(ours)[0]))
        again, _ = generate(llm, prompts[0])
        assert again == reference
        before = regular_kv(ns_dir)
        seen = set(before)
        for p in prompts[1:]:
            first, _ = generate(llm, p)
            # Saves are written after the answer, on the worker's threads: wait for one to
            # land (a loaded disk's fsync has taken seconds) before asking for the restore.
            wait_until(
                "a checkpoint of the conversation is written",
                lambda seen=seen: regular_kv(ns_dir) - seen,
            )
            seen |= regular_kv(ns_dir)
            restored, cached = generate(llm, p)
            assert restored == first and cached > 0  # saved, then restored from disk
        assert len(seen - before) >= 3  # every conversation saved a checkpoint
        assert len(regular_kv(ns_dir)) < len(seen)  # and older ones were evicted for them
    for path in glob.glob(os.path.join(ns_dir, "*.kv")) + [
        os.path.join(ns_dir, ".tmp-" + "a" * 40 + ".kv-1-dead")
    ]:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            assert os.path.lexists(path)  # skipped, never moved or followed
    assert not [
        p
        for p in verify(Store(kv, space_bytes=1 << 40, readonly=True)).problems
        if p.kind in ("bad", "misnamed", "orphan")
    ]
