"""The fault suite at length: kill -9 during saves, many times; two engines on one
directory at a tight budget, for minutes.

    .venv/bin/python benchmarks/fault_soak.py [--kills 100] [--soak-minutes 5]

1. kill -9: a process with an in-process engine and the disk cache answers growing
   prompts that share a prefix (each twice, the second from disk), and is SIGKILLed at a
   random moment once it has written something, ``--kills`` times on the same directory.
   After every kill the directory is verified (checksums, names, chains); every 10 kills a
   fresh process answers 8 prompts, each checked token for token against an engine
   without a cache.
2. two engines, one directory: both answer their own sessions (sharing a prefix) at a
   budget of about three checkpoints, for ``--soak-minutes``; the bytes on disk are
   sampled all along; at the end the directory is verified and every answer compared with
   the no-cache reference. The directory is local, or one directory of a shared volume
   seen through two clients: ``--soak-dirs A B`` (the same directory through two mounts;
   one engine on each), or ``--gluster``: a GlusterFS volume made on the local disk and
   mounted twice (``vllm_kvdisk.testing.gluster``; root and the glusterfs packages).
Writes benchmarks/results/fault_soak.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# An explicit KV size, as in the tests: without it vLLM's CPU worker refuses to start
# unless 92% of the machine's memory is free, which a busy box (or this script's own
# reference engine) does not always leave.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from crash_child import prompts  # noqa: E402

from vllm_kvdisk.storage.store import Store  # noqa: E402
from vllm_kvdisk.storage.verify import verify  # noqa: E402
from vllm_kvdisk.testing.harness import engine, generate  # noqa: E402
from vllm_kvdisk.testing.tinymodel import build_tiny_model  # noqa: E402

CHILD = REPO / "tests" / "crash_child.py"


def kv_files(kv: str) -> list[str]:
    return [p for p in glob.glob(os.path.join(kv, "*", "*.kv"))]


def child(model: str, kv: str, out: str, seed: int, count: int, **cfg) -> subprocess.Popen:
    """The child's output goes to OUT.log (kept when the soak fails)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with open(out + ".log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, str(CHILD), model, kv, out, str(seed), str(count), json.dumps(cfg)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def failed(what: str, out: str) -> SystemExit:
    with open(out + ".log", "rb") as fh:
        tail = fh.read()[-4000:].decode(errors="replace")
    return SystemExit(f"{what} failed; the end of its output:\n{tail}")


def references(model: str, counts: dict[int, int]) -> dict[int, list[list[int]]]:
    """No-cache answers of ``prompts(seed, count)`` for each seed, from one engine."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with engine(model, None, prefix_caching=False) as llm:
        return {
            seed: [generate(llm, p, max_tokens=8)[0] for p in prompts(seed, count)]
            for seed, count in counts.items()
        }


def problems(kv: str) -> list:
    report = verify(Store(kv, space_bytes=1 << 40, readonly=True))
    return [p for p in report.problems if p.kind in ("bad", "misnamed", "orphan")]


def kill_loop(model: str, work: str, kills: int, say) -> None:
    kv = os.path.join(work, "kill-kv")
    rng = random.Random(0)
    # Every 10 kills a new conversation family (seed): its children get further each time
    # (earlier prompts come back from disk), so each one is killed while saving new
    # files, and the check after the 10th restores what those killed children wrote.
    seeds = {70 + (i - 1) // 10 for i in range(1, kills + 1)}
    refs = references(model, {seed: 8 for seed in seeds})
    corrupt = checked = mismatches = restored = 0
    t0 = time.monotonic()
    for i in range(1, kills + 1):
        seed = 70 + (i - 1) // 10
        proc = child(model, kv, os.path.join(work, "kill.json"), seed, 1000)  # never runs out
        deadline = time.monotonic() + 120
        start = len(kv_files(kv))
        while len(kv_files(kv)) <= start and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        if proc.poll() is not None:  # it ended on its own: it was never killed mid-save
            raise failed(f"kill round {i}: the child", os.path.join(work, "kill.json"))
        time.sleep(rng.uniform(0.0, 2.0))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        corrupt += len(problems(kv))
        if i % 10 == 0 or i == kills:
            out = os.path.join(work, "check.json")
            done = child(model, kv, out, seed, 8)
            ref = refs[seed]
            if done.wait(timeout=900) != 0:
                raise failed("the check process", out)
            answers = json.load(open(out))
            checked += len(answers)
            mismatches += sum(not (a["first"] == a["again"] == r) for a, r in zip(answers, ref))
            restored += sum(a["cached"] > 0 for a in answers)
            say(
                f"  after {i} kills: {len(kv_files(kv))} files, corrupt/orphan so far {corrupt}, "
                f"answers checked {checked}, mismatches {mismatches}, "
                f"{time.monotonic() - t0:.0f} s"
            )
    say(
        f"1. kill -9 during saves: {kills} kills; files found corrupt, misnamed or orphaned "
        f"after a kill: {corrupt}; answers checked against no cache: {checked}, identical "
        f"{checked - mismatches} ({restored} of them restored from disk)"
    )


def soak(
    model: str, work: str, minutes: float, budget_mb: int, say, dirs: tuple[str, str] | None = None
) -> None:
    """``dirs``: one directory as each engine sees it (two mounts of a shared volume);
    None: one local directory for both."""
    kv = os.path.join(work, "soak-kv")
    kv_dirs = dirs or (kv, kv)
    kv = kv_dirs[0]
    seeds, count = (200, 201), 10_000
    outs = [os.path.join(work, f"soak-{s}.json") for s in seeds]
    procs = [
        child(model, d, out, s, count, kv_disk_space_mb=budget_mb, kv_disk_min_free_mb=0)
        for d, s, out in zip(kv_dirs, seeds, outs)
    ]
    peak, samples, t_end = 0, 0, time.monotonic() + minutes * 60
    while time.monotonic() < t_end and all(p.poll() is None for p in procs):
        total = 0
        for f in kv_files(kv):
            with contextlib.suppress(OSError):
                total += os.path.getsize(f)
        peak, samples = max(peak, total), samples + 1
        time.sleep(0.1)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=120)
    answered = [json.load(open(o)) for o in outs]
    n = [len(a) for a in answered]
    refs = references(model, dict(zip(seeds, n)))
    bad = sum(
        not (a["first"] == a["again"] == r)
        for s, answers in zip(seeds, answered)
        for a, r in zip(answers, refs[s])
    )
    store = Store(kv, space_bytes=budget_mb << 20, readonly=True)
    report = verify(store)
    where = (
        "one local directory"
        if dirs is None
        else f"one directory through two mounts ({kv_dirs[0]}, {kv_dirs[1]})"
    )
    say(
        f"2. two engines, {where}, budget {budget_mb} MiB, {minutes:g} min: "
        f"{sum(n)} prompts answered twice ({n[0]} + {n[1]}), peak on disk "
        f"{peak / 2**20:.1f} MiB over {samples} samples (budget {budget_mb} MiB, "
        f"peak/budget {peak / (budget_mb << 20):.2f}), "
        f"at the end {store.index.total_bytes / 2**20:.1f} "
        f"MiB in {len(store.index)} files; verify: {len(report.problems)} problem(s) "
        f"{sorted({p.kind for p in report.problems})}; answers "
        f"different from no cache: {bad}"
    )
    for p in report.problems:
        say(f"   verify: {p.kind} {p.ns}/{p.sha1}: {p.detail}")


@contextlib.contextmanager
def soak_dirs(args: argparse.Namespace, work: str):
    """The directory of part 2 as each engine sees it (None: a local one)."""
    if args.soak_dirs:
        yield tuple(args.soak_dirs)
    elif args.gluster:
        from vllm_kvdisk.testing import gluster

        with gluster.volume(os.path.join(work, "volume")) as vol:
            yield tuple(os.path.join(m, "soak-kv") for m in vol.mounts)
    else:
        yield None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--soak-minutes", type=float, default=5.0)
    ap.add_argument("--budget-mb", type=int, default=12)
    where = ap.add_mutually_exclusive_group()
    where.add_argument(
        "--soak-dirs",
        nargs=2,
        metavar=("A", "B"),
        help="part 2 on one directory seen through two mounts of a shared "
        "volume (one engine on each)",
    )
    where.add_argument(
        "--gluster",
        action="store_true",
        help="part 2 on a GlusterFS volume made here and mounted twice",
    )
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fault_soak.txt"))
    args = ap.parse_args()
    lines: list[str] = []

    def say(text: str) -> None:  # the output file grows with each line (a partial run shows)
        print(text, flush=True)
        lines.append(text)
        pathlib.Path(args.out).write_text("\n".join(lines) + "\n")

    work = tempfile.mkdtemp(prefix="kvdisk-fault-soak-")
    try:
        model = str(build_tiny_model(os.path.join(work, "model")))
        say("fault soak: tiny random model, in-process engines (one process each), 2-core CPU")
        if args.kills:
            kill_loop(model, work, args.kills, say)
        if args.soak_minutes:
            with soak_dirs(args, work) as dirs:
                soak(model, work, args.soak_minutes, args.budget_mb, say, dirs)
        where = (
            " --gluster"
            if args.gluster
            else f" --soak-dirs {' '.join(args.soak_dirs)}"
            if args.soak_dirs
            else ""
        )
        say(
            f"command: python benchmarks/fault_soak.py --kills {args.kills} "
            f"--soak-minutes {args.soak_minutes:g} --budget-mb {args.budget_mb}{where}"
        )
        pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
