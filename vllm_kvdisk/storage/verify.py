"""Compare the index with the directory and every file with its checksums.

Finds: files that do not parse or whose checksums fail (bad), files whose name is not the
SHA1 of their text (misnamed), chains whose parent is missing or inconsistent (orphans),
and temp files whose writer is gone; a file deleted since the scan (another replica's
eviction) is no problem. Orphans are judged after the checksum pass, under the
lock, from a fresh listing and the journal's lines since (a listing alone races a
replica's saves and evictions). With ``fix`` the bad and misnamed files go to the
quarantine (their descendants, orphans now, are deleted with them and reported so),
orphans are deleted (nothing can ever load them) and abandoned temp files removed; a
live writer's temp file is reported, never touched. Files of another format
version are listed, never changed. Memory stays bounded whatever a file claims (a
consistent header over a huge sparse file is read in chunks), and the chain check costs
one look per file, not one per file and ancestor. Pure of vLLM and torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.format import FormatError
from vllm_kvdisk.storage import fsdir
from vllm_kvdisk.storage.fileread import (
    check_layers,
    read_meta,
    read_tokens,
    read_tool_map,
    text_sha1,
)
from vllm_kvdisk.storage.fsdir import LockTimeout
from vllm_kvdisk.storage.store import Store


@dataclass(slots=True)
class Problem:
    ns: str
    sha1: str
    kind: str  # bad | misnamed | orphan | tmp | unsupported | unreadable
    detail: str
    fixed: str = ""  # what ``fix`` did about it: quarantined | deleted | removed


@dataclass(slots=True)
class Report:
    checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    writing: int = 0  # temp files of live writers (not problems)

    @property
    def fixed(self) -> int:
        return sum(1 for p in self.problems if p.fixed)

    @property
    def ok(self) -> bool:
        return not any(p.kind != "unsupported" for p in self.problems)


def check_file(
    store: Store, ns: str, sha1: str, on_bad: Callable[[str, os.stat_result], None] | None = None
) -> tuple[str, str] | None:
    """Full read of one file; (kind, reason) if it is unsound, None if it is sound.
    ``on_bad(why, stat)`` is called for an unsound file while its descriptor is still open
    (``stat``: of that descriptor), so a quarantine moves exactly the file read."""
    try:
        fd = store.open_file(ns, sha1)
    except FileNotFoundError as exc:  # evicted since the scan: no fault of the cache
        return "gone", str(exc)
    except OSError as exc:
        return "unreadable", str(exc)
    try:
        st = os.fstat(fd)
        try:
            meta = read_meta(fd, st.st_size)
            if text_sha1(fd, meta) != sha1:
                found = ("misnamed", "file name is not the SHA1 of its text")
            else:
                read_tokens(fd, meta)
                check_layers(fd, meta)
                read_tool_map(fd, meta)
                return None
        except FormatError as exc:
            found = ("bad", str(exc))
        if on_bad is not None:
            on_bad(found[1], st)
        return found
    except OSError as exc:
        return "unreadable", str(exc)
    finally:
        fsdir.close_read(fd)


def verify(
    store: Store, *, jobs: int = 1, progress: Callable[[int, int], None] | None = None
) -> Report:
    """Check everything (``jobs`` files at a time); a writable store also repairs.
    ``progress(done, total)`` is called as files are checked."""
    fix = not store.readonly
    temps = store.temp_files()  # before the scan: a writable scan removes abandoned ones
    store.scan()
    report = Report()
    for ns, sha1, why in list(store.rejected):  # did not even parse
        kind = "unsupported" if why.startswith("unsupported") else "bad"
        # A writable scan quarantined it if it could (the lock was free): it is gone.
        moved = fix and kind == "bad" and not _present(store, ns, sha1)
        report.problems.append(Problem(ns, sha1, kind, why, "quarantined" if moved else ""))
    entries = list(store.index.entries())
    total = len(entries)
    store.dropped.clear()  # descendants a quarantine below takes with it
    if progress is not None:
        progress(0, total)

    def one(entry: Entry) -> tuple[Entry, tuple[str, str] | None, bool]:
        moved = []

        def quarantine(why: str, st: os.stat_result) -> None:
            moved.append(
                store.quarantine(entry.ns, entry.sha1, why, inode=st.st_ino, dev=st.st_dev)
            )

        found = check_file(store, entry.ns, entry.sha1, quarantine if fix else None)
        return entry, found, any(moved)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for done, (entry, found, moved) in enumerate(pool.map(one, entries), start=1):
            report.checked += 1
            report.bytes_checked += entry.size
            if progress is not None:
                progress(done, total)
            if found is None or found[0] == "gone":
                continue
            kind, why = found
            report.problems.append(
                Problem(entry.ns, entry.sha1, kind, why, "quarantined" if moved else "")
            )
    for ns, sha1, why in list(store.dropped):  # orphans of a quarantined file: deleted
        report.problems.append(Problem(ns, sha1, "orphan", f"deleted: {why}", "deleted"))
    # Judged from the directory as it is after the long pass (a parent may have been saved
    # again meanwhile), and deleted in the same hold of the lock. Deleting an orphan can
    # orphan nothing new: its children are orphans already.
    unlocked = ""
    try:
        orphans, removed = store.orphans(remove=fix), fix
    except LockTimeout:  # replicas busy: report them, a later --fix deletes them
        orphans, removed = store.orphans(locked=False), False
        unlocked = " (judged without the lock, busy or unusable: a writer may have moved it)"
    for entry in orphans:
        report.problems.append(
            Problem(
                entry.ns,
                entry.sha1,
                "orphan",
                f"parent {entry.parent} missing or inconsistent{unlocked}",
                "deleted" if removed else "",
            )
        )
    for ns, name, abandoned in temps:
        if not abandoned:
            report.writing += 1
            continue
        problem = Problem(ns, name, "tmp", "unfinished write of a gone writer")
        report.problems.append(problem)
        if fix:
            store.remove_temp(ns, name)  # (the scan may have removed it already)
            problem.fixed = "removed"
    return report


def _present(store: Store, ns: str, sha1: str) -> bool:
    try:
        fsdir.close_read(store.open_file(ns, sha1))
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True
