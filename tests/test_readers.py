"""Every file version the writer produces, through every reader of the cache directory.

A file is read in two ways: its first bytes for the index (``read_summary``: a start-up
scan, the background listing, a forced refresh before an eviction, the orphan pass,
``kvdisk ls/stats/gc``) and in full for a load or ``kvdisk verify`` (``read_meta`` and the
checksums). A payload version one of them accepts and the other refuses makes a file that
loads but is never indexed: state-model files (payload version 3) were skipped by every
scan as "unsupported", so ``kvdisk verify`` checked none of them and a server forgot them
at its next listing. Each golden file goes through each reader here; a file of a version
this build does not write is "unsupported" to every one of them alike, never corrupt."""

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from synth import BLOCK, FP, LAYOUT, planner, prompt

from vllm_kvdisk.core.encode import encode_plan
from vllm_kvdisk.core.format import (
    FORMAT_VERSION,
    PAYLOAD_VERSIONS,
    Group,
    GroupKind,
    Reason,
)
from vllm_kvdisk.ops.cli import main
from vllm_kvdisk.storage.fileread import read_meta, read_summary, read_text
from vllm_kvdisk.storage.store import Store
from vllm_kvdisk.storage.verify import verify

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_FILES = sorted(p.name for p in GOLDEN.glob("*.kv"))
STATEFUL = (Group(GroupKind.FULL, 1), Group(GroupKind.STATE, 1))


def text_of(raw: bytes) -> bytes:
    (length,) = struct.unpack_from("<I", raw, 48)
    return raw[52 : 52 + length]


def ours(raw: bytes) -> bool:
    """A file of the format version this build writes (the v1 golden files are older)."""
    return raw[3] == FORMAT_VERSION


def place(root: Path, raw: bytes) -> tuple[str, str]:
    """Put ``raw`` into FP's namespace of the cache at ``root`` under its own name."""
    store = Store(str(root), space_bytes=1 << 30)
    ns = store.ensure_namespace(FP)
    sha1 = hashlib.sha1(text_of(raw)).hexdigest()
    Path(store.path(ns, sha1)).write_bytes(raw)
    store.close()
    return ns, sha1


def cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_the_golden_files_cover_every_payload_version_the_writer_produces():
    versions = set()
    for name in GOLDEN_FILES:
        raw = (GOLDEN / name).read_bytes()
        if ours(raw):
            payload_at = 52 + len(text_of(raw))
            versions.add(struct.unpack_from("<H", raw, payload_at + 4)[0])
    assert versions == set(PAYLOAD_VERSIONS)


@pytest.mark.parametrize("name", GOLDEN_FILES)
def test_every_golden_file_through_every_reader(name, tmp_path, capsys):
    raw = (GOLDEN / name).read_bytes()
    delta = struct.unpack_from("<H", raw, 6)[0] & 2 != 0  # the delta flag
    root = tmp_path / "kv"
    Store(str(root), space_bytes=1 << 30).start(background=False)  # an empty cache's journal
    ns, sha1 = place(root, raw)  # a file no journal line names (its writer was killed)
    path = Path(Store(str(root), space_bytes=1 << 30, readonly=True).path(ns, sha1))

    # The summary a scan reads says what the full parse says.
    fd = os.open(path, os.O_RDONLY)
    try:
        if ours(raw):
            summary, meta = read_summary(fd, len(raw)), read_meta(fd, len(raw))
            assert read_text(fd, meta) == text_of(raw)
            assert summary.header == meta.header
            assert (summary.parent_sha1, summary.parent_tokens, summary.token_digest) == (
                meta.payload.parent_sha1,
                meta.payload.parent_tokens,
                meta.payload.token_digest,
            )
            assert summary.ids_at == meta.offsets.tokens
    finally:
        os.close(fd)

    def indexed(store: Store) -> bool:
        found = store.index.get(ns, sha1) is not None
        refused = [why for _, s, why in store.rejected if s == sha1]
        if ours(raw):
            assert not refused, refused
        else:  # another version: left alone, never called corrupt
            assert refused and refused[0].startswith("unsupported"), refused
        return found

    # A start from the journal, then its listing (the background one, run here).
    listing = Store(str(root), space_bytes=1 << 30)
    assert listing.start(background=False)
    assert indexed(listing) == ours(raw)
    # A start by scan (no usable journal).
    os.unlink(root / ".journal")
    scanned = Store(str(root), space_bytes=1 << 30)
    assert not scanned.start(background=False)
    assert indexed(scanned) == ours(raw)
    # Another replica's hit changes the header in place: the forced refresh of an
    # eviction reads the file again and keeps it.
    if ours(raw):
        Store(str(root), space_bytes=1 << 30, readonly=False).touch(ns, sha1)
    scanned.refresh(ns, force=True)
    assert indexed(scanned) == ours(raw)
    if ours(raw):
        assert scanned.index.get(ns, sha1).hits == 1
    # The orphan pass judges the file by its chain (the golden deltas' parents are not
    # here), never skips it.
    orphans = {e.sha1 for e in scanned.orphans()}
    assert orphans == ({sha1} if ours(raw) and delta else set())
    # kvdisk verify reads it in full; ls, stats and gc see it.
    report = verify(Store(str(root), space_bytes=1 << 30, readonly=True))
    assert report.checked == (1 if ours(raw) else 0)
    kinds = sorted(p.kind for p in report.problems)
    assert kinds == (["unsupported"] if not ours(raw) else ["orphan"] if delta else [])
    code, out = cli(capsys, "ls", str(root), "--json")
    assert code == 0 and [r["sha1"] for r in json.loads(out)] == ([sha1] if ours(raw) else [])
    code, out = cli(capsys, "stats", str(root), "--json")
    assert code == 0 and json.loads(out)["files"] == (1 if ours(raw) else 0)
    code, out = cli(capsys, "gc", str(root), "--to-mb", "0", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["removed"] == (1 if ours(raw) else 0)
    # Nothing moved, rewrote or quarantined it (the hit rewrote two header fields).
    assert path.read_bytes()[48:] == raw[48:]


def save_state(store: Store, ns: str, p, length: int, rng) -> tuple[str, int]:
    """A state model's checkpoint: one full-attention layer (the blocks the file owns) and
    one state layer (the state after its last token); (sha1, byte offset of its state)."""
    plan = planner(store).plan_save(ns, p, length, Reason.COLD)
    owned = (plan.tokens - plan.parent_tokens) // BLOCK
    shape = LAYOUT.page_shape
    layers = [
        rng.random((owned, *shape), dtype=np.float32).tobytes(),
        rng.random((1, *shape), dtype=np.float32).tobytes(),
    ]
    enc = encode_plan(
        plan,
        text=p.text_upto(plan.tokens),
        ids=p.ids,
        layers=layers,
        layout=LAYOUT,
        fingerprint=FP.digest(),
        kv_dtype="float32",
        context_size=8192,
        now=1_000_000,
        groups=STATEFUL,
    )
    assert enc.payload.version == 3
    store.write(ns, plan.sha1, enc)
    return plan.sha1, enc.offsets.layer(1)


def state_chain(tmp_path) -> tuple[Store, str, list[tuple[str, int]]]:
    store = Store(str(tmp_path / "kv"), space_bytes=1 << 30)
    ns = store.ensure_namespace(FP)
    p, rng = prompt(3), np.random.default_rng(0)
    files = [save_state(store, ns, p, n, rng) for n in (48, 112)]
    assert store.index.get(ns, files[1][0]).parent == files[0][0]
    return store, ns, files


def test_a_state_models_chain_is_kept_by_every_reader(tmp_path, capsys):
    store, ns, files = state_chain(tmp_path)
    names = {sha1 for sha1, _ in files}
    root = store.root
    for start in ("journal", "scan"):
        if start == "scan":
            os.unlink(os.path.join(root, ".journal"))
        other = Store(root, space_bytes=1 << 30)
        assert other.start(background=False) == (start == "journal")
        assert {e.sha1 for e in other.index.entries()} == names, start
        assert not other.rejected
    # The writer's own forced refresh, the orphan pass, a gc that has room.
    store.refresh(ns, force=True)
    assert store.orphans(remove=True) == []
    assert {e.sha1 for e in store.index.entries()} == names
    assert store.gc_to(1 << 30) == []
    report = verify(Store(root, space_bytes=1 << 30))
    assert report.ok and report.checked == 2 and not report.problems
    code, out = cli(capsys, "verify", root)
    assert code == 0 and "checked 2 files" in out
    code, out = cli(capsys, "stats", root, "--json")
    assert json.loads(out)["files"] == 2
    assert all(os.path.exists(store.path(ns, sha1)) for sha1 in names)


@pytest.mark.parametrize("which", [0, 1])
def test_kvdisk_verify_catches_a_flipped_byte_in_a_state_models_file(tmp_path, capsys, which):
    store, ns, files = state_chain(tmp_path)
    sha1, state_at = files[which]
    with open(store.path(ns, sha1), "r+b") as fh:  # a byte of the stored state
        fh.seek(state_at + 5)
        byte = fh.read(1)
        fh.seek(state_at + 5)
        fh.write(bytes([byte[0] ^ 0x10]))
    code, out = cli(capsys, "verify", store.root)
    assert code == 1
    assert f"bad         {ns}/{sha1}: checksum mismatch in layer 1" in out
    assert "checked 2 files" in out
