"""Hostile entries in the cache directory: FIFOs, sockets, device nodes, directories and
hard links named like our files, hostile ``namespace.json`` files, huge sparse files and
very long chains. None may hang, crash or stop a reader: each is skipped (never opened
blocking, never followed), a miss, or a message and an exit code.

A FIFO opened for reading without ``O_NONBLOCK`` waits for a writer forever: the tests
that plant one carry a timeout, so a regression fails instead of stalling the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import socket
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Callable

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synth import FP, make, planner, prompt, save

from vllm_kvdisk.core.encode import encode_checkpoint
from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.format import HEADER, PAYLOAD_FIXED, FormatError, PageLayout, Payload, Reason
from vllm_kvdisk.core.index import Index
from vllm_kvdisk.ops.cli import main
from vllm_kvdisk.ops.trace import Trace
from vllm_kvdisk.ops.trace import read as read_trace
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage.fileread import read_meta, read_summary
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify

HANG = pytest.mark.timeout(20)  # a blocking open of a FIFO never returns: fail, not stall
KINDS = ["fifo", "socket", "device", "directory"]


def plant(path: str, kind: str) -> None:
    """Put a non-regular entry of ``kind`` at ``path`` (replacing what is there), the way
    another process would: made beside it, then renamed over it."""
    tmp = path + ".planting"
    if kind == "fifo":
        os.mkfifo(tmp, 0o600)
    elif kind == "socket":
        # AF_UNIX paths are limited to ~108 bytes: bind relative to the directory.
        here = os.getcwd()
        os.chdir(os.path.dirname(tmp))
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(os.path.basename(tmp))
            sock.close()
        finally:
            os.chdir(here)
    elif kind == "device":  # like /dev/null: harmless if anything ever did open it
        os.mknod(tmp, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    elif kind == "directory":
        os.mkdir(tmp, 0o700)
    else:
        raise ValueError(kind)
    if kind == "directory" and os.path.lexists(path):
        os.unlink(path)
    os.rename(tmp, path)


def scandir_then(swap: Callable[[list[os.DirEntry]], None]) -> Callable:
    """An ``os.scandir`` stand-in: the real listing, read whole with each entry's type as
    the listing saw it, then ``swap(entries)`` changes the directory before the caller
    looks at any entry (a FIFO renamed in between the listing and the open)."""
    real_scandir = os.scandir

    @contextlib.contextmanager
    def listing_then_swap(fd):
        with real_scandir(fd) as it:
            entries = list(it)
        for de in entries:
            de.is_file(follow_symlinks=False)  # cache what the listing saw
        swap(entries)
        yield iter(entries)

    return listing_then_swap


def no_traceback(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    assert isinstance(code, int) and "Traceback" not in out.err, out.err
    return code, out.out, out.err


# -- special files under every reader -------------------------------------------------


@HANG
@pytest.mark.parametrize("kind", KINDS)
def test_a_special_temp_file_never_hangs_a_scan_a_save_or_verify(tmp_path, kind):
    """A FIFO named like a temp file older than the grace period: the scan asks whether its
    writer is gone, and that question must not open it blocking (a save asks it under
    ROOT/.lock: every other replica's saves would time out behind it)."""
    store, ns = make(tmp_path)
    name = os.path.join(store.ns_dir(ns), ".tmp-" + "a" * 40 + ".kv-1-x")
    plant(name, kind)
    os.utime(name, (0, 0), follow_symlinks=False)
    store.scan()
    save(store, ns, prompt(1), 48, np.random.default_rng(0))  # re-lists under the lock
    fresh = Store(store.root, space_bytes=1 << 30)
    report = verify(fresh)  # --fix
    assert report.ok and report.writing == 0, report.problems
    assert os.path.lexists(name)  # not ours: left alone, never removed as a dead writer's
    assert len(fresh.index) == 1


@HANG
@pytest.mark.parametrize("kind", KINDS)
def test_a_special_file_in_place_of_an_indexed_checkpoint_is_a_miss(tmp_path, kind):
    """Another process puts a FIFO (socket, device node, directory) where an indexed file
    was. The index still has the entry until its next refresh: a lookup that reads its ids
    (a prompt leaving it partway), a hit count, the CLI and verify must not open it
    blocking, and nothing may move it to the quarantine as if it were a corrupt file."""
    store, ns = make(tmp_path)
    p = prompt(2)
    rng = np.random.default_rng(0)
    root, _ = save(store, ns, p, 48, rng)
    child, _ = save(store, ns, p, 112, rng)
    path = store.path(ns, child.sha1)
    plant(path, kind)
    entry = store.index.get(ns, child.sha1)
    assert store.read_ids(entry, 48, 112) is None
    other = p.ids.copy()
    other[100] = (other[100] + 1) % 262  # leaves the child partway: its ids must be read
    hit = planner(store).lookup(ns, other, 399)
    assert [e.sha1 for e in hit.chain] == [root.sha1]
    store.touch(ns, child.sha1)
    with pytest.raises(OSError), store.open(ns, child.sha1):
        pass
    assert not store.quarantine(ns, child.sha1, "checksum mismatch", inode=entry.inode)
    assert os.path.lexists(path) and store.quarantined_files() == []
    store.refresh(ns, force=True)
    assert store.index.get(ns, child.sha1) is None and store.index.get(ns, root.sha1)
    assert verify(Store(store.root, space_bytes=1 << 30)).ok
    assert os.path.lexists(path)


@HANG
@pytest.mark.parametrize("kind", KINDS)
def test_a_special_file_swapped_in_after_the_listing_is_skipped_by_the_scan(
    tmp_path, kind, monkeypatch
):
    """The listing said regular file; by the time the scan opens it, it is a FIFO."""
    store, ns = make(tmp_path)
    plan, _ = save(store, ns, prompt(3), 48, np.random.default_rng(0))
    path = store.path(ns, plan.sha1)
    real_scandir = os.scandir

    def swap(entries):
        if any(de.name == f"{plan.sha1}.kv" for de in entries):
            plant(path, kind)

    fresh = Store(store.root, space_bytes=1 << 30)
    monkeypatch.setattr(os, "scandir", scandir_then(swap))
    fresh.scan()
    monkeypatch.setattr(os, "scandir", real_scandir)
    assert len(fresh.index) == 0 and fresh.quarantined_files() == []
    assert os.path.lexists(path)


@HANG
@pytest.mark.parametrize("kind", KINDS)
def test_the_cli_never_hangs_or_crashes_on_special_files(tmp_path, kind, capsys):
    store, ns = make(tmp_path)
    plan, _ = save(store, ns, prompt(4), 48, np.random.default_rng(0))
    bogus = os.path.join(store.ns_dir(ns), "b" * 40 + ".kv")
    plant(bogus, kind)
    info = os.path.join(store.ns_dir(ns), "namespace.json")
    plant(info, kind)
    code, _, err = no_traceback(capsys, "inspect", bogus)
    assert code == 2 and "not a regular file" in err
    assert no_traceback(capsys, "ls", store.root)[0] == 0
    assert no_traceback(capsys, "stats", store.root)[0] == 0
    assert no_traceback(capsys, "verify", store.root)[0] == 0
    assert no_traceback(capsys, "gc", store.root, "--to-mb", "0")[0] == 0
    assert not os.path.exists(store.path(ns, plan.sha1))
    code, out, _ = no_traceback(capsys, "rm", store.root, "--namespace", ns)
    assert code == 0 and "removed" in out
    assert not os.path.lexists(store.ns_dir(ns))  # special entries went with it


@HANG
def test_a_fifo_at_the_trace_path_never_hangs_start_up_or_a_reader(tmp_path):
    path = str(tmp_path / "trace.txt")
    os.mkfifo(path, 0o600)
    trace = Trace(path)
    trace.saved("cold", "a" * 40, 128, 4096, 0.01)  # goes nowhere; never blocks
    assert read_trace(path) == []
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a reader appears: still refused
    try:
        trace = Trace(path)
        trace.saved("cold", "a" * 40, 128, 4096, 0.01)
        assert os.read(reader, 4096) == b""
    finally:
        os.close(reader)
    dev = str(tmp_path / "trace-dev.txt")
    os.mknod(dev, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    assert read_trace(dev) == [] and Trace(dev).enabled is False


@HANG
def test_a_fifo_in_place_of_a_tool_call_log_never_hangs_the_reader(tmp_path, monkeypatch):
    from vllm_kvdisk.replay.log import DIRNAME, ToolCall, ToolLog

    root = str(tmp_path / "kv")
    writer = ToolLog(root, "scope", 64)
    assert writer.append(ToolCall(("call_1",), "text", (1, 2, 3), "t", bytes(32)))
    reader = ToolLog(root, "scope", 64)
    logs = os.path.join(root, DIRNAME)
    victim = next(n for n in os.listdir(logs) if n.endswith(".ktl"))
    real_scandir = os.scandir
    monkeypatch.setattr(
        os, "scandir", scandir_then(lambda entries: plant(os.path.join(logs, victim), "fifo"))
    )
    assert reader.poll() == []
    monkeypatch.setattr(os, "scandir", real_scandir)
    os.utime(os.path.join(logs, victim), (0, 0), follow_symlinks=False)
    assert reader.fold_dead([]) == 0


def test_a_hard_link_is_read_but_never_written_through(tmp_path):
    """A checkpoint name hard-linked to a file elsewhere (another cache, a backup): its
    content is checked like any file's, but the hit count is never written in place, so
    the other name's file is never changed through ours."""
    store, ns = make(tmp_path)
    plan, _ = save(store, ns, prompt(5), 48, np.random.default_rng(0))
    outside = str(tmp_path / "elsewhere.kv")
    os.link(store.path(ns, plan.sha1), outside)
    before = open(outside, "rb").read()
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()
    assert fresh.index.get(ns, plan.sha1) is not None
    fresh.touch(ns, plan.sha1)
    assert open(outside, "rb").read() == before
    assert verify(fresh).ok
    fresh.gc_to(0)
    assert not os.path.exists(store.path(ns, plan.sha1))
    assert open(outside, "rb").read() == before


# -- restore --------------------------------------------------------------------------


@HANG
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_special_file_in_a_chain_being_restored_is_recomputed_not_quarantined(tmp_path, kind):
    torch = pytest.importorskip("torch")
    import workers

    from vllm_kvdisk.connector.jobs import LoadFile

    torch.manual_seed(0)
    layers = {f"model.layers.{i}.attn": torch.rand(64, 2, workers.BLOCK, 8) for i in range(4)}
    w = workers.make_worker(tmp_path, layers)
    ids = np.arange(10_000, 10_000 + 64 * workers.BLOCK, dtype="<u4")
    try:
        sha1 = workers.save(w, workers.save_job(ids, list(range(8))))
        path = w.store.path(workers.FP.dirname(), sha1)
        plant(path, kind)
        targets = list(range(20, 28))
        tokens = 8 * workers.BLOCK
        job = workers.load_job(ids, [LoadFile(sha1, 0, tokens, tokens)], 0, targets)
        assert w.loads.load(job) == targets
        assert os.path.lexists(path) and w.store.quarantined_files() == []
    finally:
        w.shutdown()


# -- namespace.json -------------------------------------------------------------------

HOSTILE_INFO = {
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "deep_inside": (b'{"tp_size": 2, "x": ' + b"[" * 990 + b"]" * 990 + b"}"),
    "overflow": b'{"tp_size": 1e400, "model": "tiny"}',
    "nan": b'{"tp_size": NaN}',
    "huge_int": b'{"tp_size": ' + b"9" * 5000 + b"}",
    "not_a_dict": b"[1, 2, 3]",
    "not_utf8": b'{"model": "\xff\xfe"}',
    "nested_values": b'{"tp_size": 2, "model": {"a": [1, 2]}}',
    "empty": b"",
}


def plant_foreign_namespace(store: Store, name: str, info: bytes, seed: int) -> str:
    """A namespace directory with one sound checkpoint and the given namespace.json."""
    other = Store(store.root, space_bytes=1 << 30)
    ns = other.ensure_namespace(FP)
    plan, _ = save(other, ns, prompt(seed), 48, np.random.default_rng(seed))
    os.makedirs(os.path.join(store.root, name), mode=0o700)
    os.rename(other.path(ns, plan.sha1), os.path.join(store.root, name, f"{plan.sha1}.kv"))
    with open(os.path.join(store.root, name, "namespace.json"), "wb") as fh:
        fh.write(info)
    other.close()
    return plan.sha1


@HANG
@pytest.mark.parametrize("case", sorted(HOSTILE_INFO) + ["huge_sparse", "fifo"])
def test_a_hostile_namespace_json_never_stops_eviction_or_the_cli(tmp_path, case, capsys):
    now = [1_000_000.0]
    store, ns = make(tmp_path, space_bytes=1 << 30, clock=lambda: now[0])
    foreign = "f00dfeedf00dfeed"
    if case == "huge_sparse":
        plant_foreign_namespace(store, foreign, b"", 10)
        with open(os.path.join(store.root, foreign, "namespace.json"), "r+b") as fh:
            fh.write(b'{"tp_size": 2, "model": "')
            fh.truncate(1 << 30)
    elif case == "fifo":
        plant_foreign_namespace(store, foreign, b"", 10)
        plant(os.path.join(store.root, foreign, "namespace.json"), "fifo")
    else:
        plant_foreign_namespace(store, foreign, HOSTILE_INFO[case], 10)
    store.scan()
    assert len(store.index) == 1
    info = store.namespace_info(foreign)
    assert info is None or isinstance(info, dict)
    store.rank_groups()
    # Fill the budget: every further save must evict, and every eviction reads every
    # namespace's namespace.json to group TP ranks.
    store.space_bytes = store.index.total_bytes + 1
    rng = np.random.default_rng(1)
    for i in range(3):
        now[0] += 10
        save(store, ns, prompt(20 + i), 48, rng)
    assert store.stats.evicted >= 2 and store.stats.written == 3
    for argv in (
        ("ls", store.root),
        ("ls", store.root, "--json"),
        ("stats", store.root),
        ("stats", store.root, "--json"),
        ("gc", store.root, "--to-mb", "1000"),
        ("rm", store.root, "--model", "nobody"),
    ):
        code, _, _ = no_traceback(capsys, *argv)
        assert code in (0, 2)
    code, out, _ = no_traceback(capsys, "rm", store.root, "--namespace", foreign)
    assert code == 0 and not os.path.lexists(os.path.join(store.root, foreign))


_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_keys = st.sampled_from(
    [
        "tp_size",
        "tp_rank",
        "model",
        "revision",
        "digest",
        "kv_dtype",
        "block_size",
        "lora",
        "salt_digest",
        "format_version",
    ]
)


def _info_bytes():
    as_json = st.builds(lambda v: json.dumps(v).encode(), _json)
    ours_ish = st.builds(lambda d: json.dumps(d).encode(), st.dictionaries(_keys, _json))
    nested = st.builds(
        lambda n, v: b"[" * n + json.dumps(v).encode() + b"]" * n, st.integers(0, 5000), _scalars
    )
    mangled = st.builds(lambda b, cut: b[:cut], ours_ish, st.integers(0, 200))
    return st.one_of(
        st.binary(max_size=300),
        as_json,
        ours_ish,
        nested,
        mangled,
        st.builds(
            lambda s: b'{"tp_size": ' + s.encode() + b"}",
            st.sampled_from(
                [
                    "1e400",
                    "-1e400",
                    "NaN",
                    "Infinity",
                    "2.5",
                    "true",
                    '"2"',
                    "null",
                    "9" * 4400,
                    "[2]",
                    "{}",
                ]
            ),
        ),
    )


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(raw=_info_bytes())
def test_fuzz_namespace_json_through_every_reader(tmp_path_factory, raw):
    from vllm_kvdisk.ops.cli import namespace_label

    root = tmp_path_factory.mktemp("fuzz")
    store, ns = make(root)
    save(store, ns, prompt(6), 48, np.random.default_rng(0))
    with open(os.path.join(store.ns_dir(ns), "namespace.json"), "wb") as fh:
        fh.write(raw)
    fresh = Store(store.root, space_bytes=1 << 30)
    fresh.scan()
    info = fresh.namespace_info(ns)
    assert info is None or isinstance(info, dict)
    groups = fresh.rank_groups()
    assert all(isinstance(g, str) for g in groups.values())
    label = namespace_label(fresh, ns)
    json.dumps(label)  # what `ls --json` and `stats --json` print
    assert fresh.evict(1 << 40) and len(fresh.index) == 0
    fresh.close()
    store.close()


# -- the codec's parse ---------------------------------------------------------------


def _sound_file(tmp_path, text_len: int = 64) -> bytes:
    store, ns = make(tmp_path)
    plan, _ = save(store, ns, prompt(7), 48, np.random.default_rng(0))
    return open(store.path(ns, plan.sha1), "rb").read()


def _parse(raw: bytes, tmp_path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(raw)
    fd = os.open(path, os.O_RDONLY)
    try:
        for reader in (read_summary, read_meta):
            with contextlib.suppress(FormatError):
                reader(fd, len(raw))
    finally:
        os.close(fd)


def test_read_summary_of_a_long_text_and_a_tiny_payload_is_a_format_error(tmp_path):
    """Text past the first 4 KiB, payload shorter than its fixed header: the second read
    must not be shorter than what is unpacked from it."""
    text = b"x" * 5000
    payload_bytes = 100
    header = HEADER.pack(b"KVC", 1, 1, 1, 0, 16, 0, 8192, 0, 0, payload_bytes)
    # magic, version, fixed length, namespace, no parent, parent tokens 0, block 16,
    # first block 0, 1 block, 1 layer: sound as far as it goes, then cut at 100 bytes.
    fixed = struct.pack(
        "<4sHH32s20sIIIII", b"KVDP", 1, PAYLOAD_FIXED.size, bytes(32), bytes(20), 0, 16, 0, 1, 1
    )
    raw = (
        header
        + len(text).to_bytes(4, "little")
        + text
        + (fixed + bytes(payload_bytes))[:payload_bytes]
    )
    path = tmp_path / "tiny.kv"
    path.write_bytes(raw)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(FormatError):
            read_summary(fd, len(raw))
        with pytest.raises(FormatError):
            read_meta(fd, len(raw))
    finally:
        os.close(fd)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzz_the_opening_parse_raises_only_format_errors(tmp_path_factory, data):
    base = tmp_path_factory.getbasetemp() / "sound.kv"
    if not base.exists():
        base.write_bytes(_sound_file(tmp_path_factory.mktemp("sound")))
    raw = bytearray(base.read_bytes())
    for _ in range(data.draw(st.integers(0, 6))):
        at = data.draw(st.integers(0, len(raw) - 1))
        width = data.draw(st.sampled_from([1, 2, 4, 8]))
        raw[at : at + width] = data.draw(st.binary(min_size=width, max_size=width))
    if data.draw(st.booleans()):  # a payload too short for what it claims to hold
        raw[40:48] = data.draw(st.integers(0, 400)).to_bytes(8, "little")
    if data.draw(st.booleans()):  # a long text pushes the payload out of the first page
        grow = data.draw(st.integers(0, 9000))
        text_len = int.from_bytes(raw[48:52], "little")
        raw[48:52] = (text_len + grow).to_bytes(4, "little")
        raw[52 + text_len : 52 + text_len] = bytes(grow)
    raw = raw[: data.draw(st.integers(0, len(raw)))]
    _parse(bytes(raw), tmp_path_factory.mktemp("fuzz"), "f.kv")


# -- huge sparse files ----------------------------------------------------------------


def _sparse_checkpoint(directory: str, layer_gib: int) -> str:
    """A sound checkpoint (every checksum right) whose layers are ``layer_gib`` GiB of
    zeros each, written as holes: it takes no room on disk."""
    block = 16
    layout = PageLayout("test:big", block, 2, (64, 1024, 1024), "float32")  # 256 MiB pages
    blocks = layer_gib * (1 << 30) // layout.page_bytes
    tokens = blocks * block
    ids = np.arange(tokens, dtype="<u4").tobytes()
    text = b"sparse " * (tokens // 7 + 1)
    zeros = bytes(layout.page_bytes * blocks)  # calloc: never touched, takes no memory
    payload = Payload(bytes(32), None, 0, 0, blocks, layout, xxhash.xxh3_64_intdigest(ids))
    enc = encode_checkpoint(
        text=text,
        tokens=ids,
        layers=[zeros, zeros],
        payload=payload,
        reason=Reason.COLD,
        kv_dtype="float32",
        context_size=8192,
        now=1,
    )
    name = hashlib.sha1(text).hexdigest() + ".kv"
    path = os.path.join(directory, name)
    with open(path, "wb") as fh:
        for buf in enc.buffers[:7]:  # everything before the pages
            fh.write(buf)
        fh.truncate(enc.size)
    return path


def test_verify_reads_a_huge_sparse_file_in_bounded_memory(tmp_path):
    """A consistent header over 2 GiB of holes: verify checks every byte with a bounded
    buffer (the kvdisk process runs with 1 GiB of address space)."""
    store, ns = make(tmp_path)
    path = _sparse_checkpoint(store.ns_dir(ns), 1)
    assert os.stat(path).st_size > 2 << 30 and os.stat(path).st_blocks * 512 < 1 << 20
    limit = 1 << 30

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    for argv in (
        ["verify", store.root],
        ["verify", store.root, "--json"],
        ["inspect", path],
        ["ls", store.root],
        ["stats", store.root],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "vllm_kvdisk.ops.cli", *argv],
            capture_output=True,
            text=True,
            preexec_fn=cap,
            timeout=300,
        )
        assert out.returncode == 0 and "Traceback" not in out.stderr, (argv, out.stderr)
    assert verify(Store(store.root, space_bytes=1 << 40, readonly=True)).checked == 1


# -- long chains ----------------------------------------------------------------------


def _chain_index(depth: int, block: int = 16) -> tuple[Index, np.ndarray]:
    """An index holding one chain of ``depth`` one-block files (no files needed: whole
    files match by their token digest)."""
    ids = np.arange(depth * block, dtype="<u4") % 50_000
    index = Index()
    parent = None
    for i in range(depth):
        end = (i + 1) * block
        sha1 = hashlib.sha1(f"f{i}".encode()).hexdigest()
        head = xxhash.xxh3_64_intdigest(ids[i * block : end].tobytes())
        digest = xxhash.xxh3_64_intdigest(ids[:end].tobytes())
        index.add(
            Entry(
                "ns",
                sha1,
                end,
                parent,
                i * block,
                Reason.COLD,
                0,
                0,
                0,
                4096,
                digest,
                head,
                inode=i + 1,
            )
        )
        parent = sha1
    return index, ids


@pytest.mark.timeout(60)
def test_a_chain_of_ten_thousand_files_restores_completely():
    index, ids = _chain_index(10_000)
    hit = index.lookup("ns", ids, len(ids), 16, lambda e, a, b: None)
    assert hit.tokens == len(ids) and len(hit.chain) == 10_000


def test_the_orphan_pass_is_linear_in_the_files():
    """Every file's chain is checked, but each link is looked at a bounded number of
    times, not once per descendant (files x depth)."""
    index, _ = _chain_index(2_000)
    index.remove("ns", hashlib.sha1(b"f1000").hexdigest())  # orphans 999 files below it
    probes = [0]
    real = index._entries

    class Counting(dict):
        def get(self, key, default=None):
            probes[0] += 1
            return dict.get(self, key, default)

    index._entries = Counting(real)
    orphans = index.orphans()
    assert len(orphans) == 999
    assert probes[0] <= 4 * 2_000, probes[0]


# -- quarantine identity --------------------------------------------------------------


def test_quarantine_never_moves_a_replacement_renamed_into_place_meanwhile(tmp_path, monkeypatch):
    """The check (is it still the file we read?) and the rename happen under ROOT/.lock,
    the lock every writer renames under: a sound replacement written by another replica
    between them lands after the move and stays."""
    import fcntl

    from vllm_kvdisk.storage import quarantine as quarantine_mod

    store, ns = make(tmp_path)
    plan, layers = save(store, ns, prompt(8), 48, np.random.default_rng(0))
    path = store.path(ns, plan.sha1)
    sound = open(path, "rb").read()
    raw = bytearray(sound)
    raw[-100] ^= 0x40
    open(path, "wb").write(bytes(raw))
    replacement = os.path.join(store.ns_dir(ns), ".replacement")
    open(replacement, "wb").write(sound)
    fd = os.open(path, os.O_RDONLY)  # what the reader read and proved corrupt
    identity = os.fstat(fd)
    waiting, done = threading.Event(), threading.Event()
    real_flock = fcntl.flock

    def flock(fd_, op):
        try:
            return real_flock(fd_, op)
        except BlockingIOError:
            if threading.current_thread().name == "replica":
                waiting.set()
            raise

    monkeypatch.setattr(fsdir.fcntl, "flock", flock)

    def replica() -> None:
        """Another process's save: rename into place under the lock."""
        root_fd = os.open(store.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with fsdir.locked(root_fd, 30):
                os.replace(replacement, path)
        finally:
            os.close(root_fd)
            done.set()

    real_stat = quarantine_mod.os.stat
    started = []

    def stat_then_race(name, *args, **kwargs):
        result = real_stat(name, *args, **kwargs)
        if name == f"{plan.sha1}.kv" and not started:
            started.append(threading.Thread(target=replica, name="replica"))
            started[0].start()
            # The replica either finishes its rename (no lock held here) or waits on it.
            while not (waiting.is_set() or done.is_set()):
                waiting.wait(0.01)
        return result

    monkeypatch.setattr(quarantine_mod.os, "stat", stat_then_race)
    try:
        assert store.quarantine(ns, plan.sha1, "checksum mismatch", inode=identity.st_ino)
    finally:
        os.close(fd)
    started[0].join()
    assert open(path, "rb").read() == sound  # the replacement survived
    moved = store.quarantined_files()
    assert len(moved) == 1
    assert open(os.path.join(store.root, "quarantine", moved[0]), "rb").read() == bytes(raw)
