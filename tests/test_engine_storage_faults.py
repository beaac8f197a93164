"""The fault suite on real engines: kill -9 during saves, ENOSPC and EIO in the write and
read paths, a really full file system, two engines on one directory at a tight budget.
(``benchmarks/fault_soak.py`` runs the kill loop 100 times and the two engines for minutes.)
"""

import contextlib
import errno
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from crash_child import prompts
from engine import engine, events, generate, random_prompt
from helpers import kv_files

from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify

pytestmark = pytest.mark.engine
CHILD = os.path.join(os.path.dirname(__file__), "crash_child.py")


def start_child(model: str, kv: str, out: str, seed: int, count: int, **cfg) -> subprocess.Popen:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return subprocess.Popen(
        [sys.executable, CHILD, model, kv, out, str(seed), str(count), json.dumps(cfg)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def references(model: str, seed: int, count: int) -> list[list[int]]:
    with engine(model, None, prefix_caching=False) as llm:
        return [generate(llm, p, max_tokens=8)[0] for p in prompts(seed, count)]


def test_kill_9_during_saves_leaves_nothing_corrupt_and_answers_stay_exact(tiny_model, tmp_path):
    kv = str(tmp_path / "kv")
    rng = random.Random(0)
    killed = 0
    for round_ in range(3):
        out = str(tmp_path / f"answers-{round_}.json")
        proc = start_child(tiny_model, kv, out, seed=70, count=40)
        deadline = time.monotonic() + 120
        while len(kv_files(kv)) < 2 + 2 * round_ and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))  # somewhere in the middle of a save
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        killed += proc.returncode == -signal.SIGKILL
    assert killed == 3
    # What a crashed writer leaves: complete files and, at worst, its temp files.
    report = verify(Store(kv, space_bytes=1 << 40, readonly=True))
    assert not [p for p in report.problems if p.kind in ("bad", "misnamed", "orphan")]
    out = str(tmp_path / "answers-final.json")
    proc = start_child(tiny_model, kv, out, seed=70, count=8)
    assert proc.wait(timeout=600) == 0
    answers = json.load(open(out))
    assert all(
        a["first"] == a["again"] == ref for a, ref in zip(answers, references(tiny_model, 70, 8))
    )
    assert any(a["cached"] > 0 for a in answers)  # the survivors were used
    fixed = verify(Store(kv, space_bytes=1 << 40))  # --fix: dead writers' temp files go
    assert not [p for p in fixed.problems if p.kind != "tmp"], fixed.problems
    assert not glob.glob(os.path.join(kv, "*", ".tmp-*"))
    assert verify(Store(kv, space_bytes=1 << 40, readonly=True)).ok


def test_enospc_and_eio_cost_a_checkpoint_never_an_answer(tiny_model, tmp_path, monkeypatch):
    import vllm_kvdisk.connector.restore as restore_mod
    import vllm_kvdisk.storage.fsdir as fsdir

    kv, trace = str(tmp_path / "kv"), str(tmp_path / "trace.txt")
    prompt = random_prompt(1500, seed=71)
    with engine(tiny_model, None, prefix_caching=False) as llm:
        reference, _ = generate(llm, prompt)
    real_write, real_read = fsdir.writev_all, restore_mod.read_layers_into

    def no_space(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    def io_error(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    with engine(tiny_model, kv, trace=trace) as llm:
        monkeypatch.setattr(fsdir, "writev_all", no_space)
        tokens, _ = generate(llm, prompt)
        assert tokens == reference and kv_files(kv) == []
        assert not glob.glob(os.path.join(kv, "*", ".tmp-*"))  # nothing half-visible
        monkeypatch.setattr(fsdir, "writev_all", real_write)
        llm.reset_prefix_cache()
        generate(llm, prompt)  # saved now
        assert kv_files(kv)
        monkeypatch.setattr(restore_mod, "read_layers_into", io_error)
        llm.reset_prefix_cache()
        tokens, _ = generate(llm, prompt)  # the load fails: recomputed
        assert tokens == reference
        assert kv_files(kv) and not os.path.isdir(
            os.path.join(kv, "quarantine")
        )  # EIO is no corruption
        monkeypatch.setattr(restore_mod, "read_layers_into", real_read)
        llm.reset_prefix_cache()
        tokens, cached = generate(llm, prompt)
        assert tokens == reference and cached == 1408  # the same file serves again
    fails = [e for e in events(trace, "save_failed")]
    assert fails and "No space left" in fails[0].detail


@contextlib.contextmanager
def small_file_system(path: str, megabytes: int):
    """A real tmpfs of ``megabytes`` (root can mount one here)."""
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m,mode=0700", "tmpfs", path],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def test_a_really_full_file_system_skips_saves_and_keeps_serving(tiny_model, tmp_path):
    # The volume's size is set for raw files (~3.6 MB each): compressed ones would fit
    # where this test needs them not to.
    raw = {"kv_disk_compression": "off"}
    with small_file_system(str(tmp_path / "small"), 12) as root:
        kv, trace = os.path.join(root, "kv"), str(tmp_path / "trace.txt")
        prompts_ = [random_prompt(1000, seed=80 + i) for i in range(6)]  # ~3.6 MB files
        with engine(tiny_model, None, prefix_caching=False) as llm:
            reference = [generate(llm, p)[0] for p in prompts_]
        # The budget says 1 GiB, the volume holds 12 MiB: the volume is the limit.
        with engine(
            tiny_model, kv, trace=trace, kv_disk_space_mb=1024, kv_disk_min_free_mb=0, **raw
        ) as llm:
            got = [generate(llm, p)[0] for p in prompts_]
            llm.reset_prefix_cache()
            again = [generate(llm, p) for p in prompts_[-2:]]
        assert got == reference and [t for t, _ in again] == reference[-2:]
        assert sum(os.path.getsize(p) for p in kv_files(kv)) <= 12 << 20
        assert verify(Store(kv, space_bytes=1 << 40, readonly=True)).ok
        assert not glob.glob(os.path.join(kv, "*", ".tmp-*"))
        assert any(cached for _, cached in again)  # the newest checkpoints survived
        assert events(trace, "evicted")  # the volume, not the budget, made room
        # Something else fills the volume: a watermark that cannot be met skips every
        # save and evicts nothing.
        kept = sorted(kv_files(kv))
        filler = os.path.join(root, "filler")
        with open(filler, "wb") as fh, contextlib.suppress(OSError):
            fh.write(b"\0" * (12 << 20))
        with engine(
            tiny_model, kv, trace=trace, kv_disk_space_mb=1024, kv_disk_min_free_mb=8, **raw
        ) as llm:
            assert generate(llm, random_prompt(1000, seed=90))[0]
        assert sorted(kv_files(kv)) == kept
        assert any(e.reason == "no_space" for e in events(trace, "save_skipped"))


def test_two_engines_on_one_directory_keep_one_budget(tiny_model, tmp_path):
    kv = str(tmp_path / "kv")
    budget_mb = 12  # about three 1000-token checkpoints for both engines together
    outs = [str(tmp_path / f"answers-{i}.json") for i in range(2)]
    trace = str(tmp_path / "trace.txt")  # both engines append to it
    procs = [
        start_child(
            tiny_model,
            kv,
            outs[i],
            seed=100 + i,
            count=8,
            trace=trace,
            kv_disk_space_mb=budget_mb,
            kv_disk_min_free_mb=0,
        )
        for i in range(2)
    ]
    peak = 0
    while any(p.poll() is None for p in procs):
        total = 0
        for f in kv_files(kv):
            with contextlib.suppress(OSError):
                total += os.path.getsize(f)
        peak = max(peak, total)
        time.sleep(0.05)
    assert [p.returncode for p in procs] == [0, 0]
    one_file = 6 << 20
    assert peak <= (budget_mb << 20) + one_file  # one budget (a rename may land mid-scan)
    store = Store(kv, space_bytes=budget_mb << 20, readonly=True)
    report = verify(store)
    assert report.ok, report.problems  # no orphans, nothing corrupt
    assert store.index.total_bytes <= budget_mb << 20
    written = sum(e.bytes for e in events(trace, "saved"))
    assert written > 2 * (budget_mb << 20) and events(trace, "evicted")  # the budget bit
    for i in range(2):
        answers = json.load(open(outs[i]))
        assert (
            [a["first"] for a in answers]
            == [a["again"] for a in answers]
            == references(tiny_model, 100 + i, 8)
        )
