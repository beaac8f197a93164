"""Compare the index with the directory and every file with its checksums.

Finds: files that do not parse or whose checksums fail (bad), files whose name is not the
SHA1 of their text (misnamed), chains whose parent is missing or inconsistent (orphans),
and temp files left by a crashed writer. With ``fix`` the bad and misnamed files go to the
quarantine and orphans are deleted (nothing can ever load them). Pure of vLLM and torch.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from vllm_kvdisk.format import FormatError, read_layer_into, read_text, read_tokens, read_tool_map
from vllm_kvdisk.store import Store


@dataclass(slots=True)
class Problem:
    ns: str
    sha1: str
    kind: str  # bad | misnamed | orphan | tmp
    detail: str


@dataclass(slots=True)
class Report:
    checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    fixed: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def check_file(store: Store, ns: str, sha1: str) -> str | None:
    """Full read of one file; the reason it is unsound, or None."""
    try:
        with store.open(ns, sha1) as (fd, meta, _):
            if hashlib.sha1(read_text(fd, meta)).hexdigest() != sha1:
                return "misnamed: file name is not the SHA1 of its text"
            read_tokens(fd, meta)
            buf = memoryview(bytearray(meta.offsets.layer_bytes))
            for layer in range(meta.payload.layout.num_layers):
                read_layer_into(fd, meta, layer, buf)
            read_tool_map(fd, meta)
    except FormatError as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable: {exc}"
    return None


def verify(store: Store) -> Report:
    """Check everything; a writable store also repairs (quarantine, drop orphans and tmp)."""
    fix = not store.readonly
    store.scan()
    report = Report()
    for ns, sha1, why in store.rejected:  # did not even parse: quarantined unless read-only
        report.problems.append(Problem(ns, sha1, "bad", why))
        report.fixed += 0 if store.readonly else 1
    for entry in list(store.index.entries()):
        report.checked += 1
        report.bytes_checked += entry.size
        why = check_file(store, entry.ns, entry.sha1)
        if why is not None:
            report.problems.append(Problem(entry.ns, entry.sha1, "bad", why))
            if fix:
                store.quarantine(entry.ns, entry.sha1, why)
                report.fixed += 1
    for entry in list(store.index.entries()):
        if entry.parent and store.index.chain(entry.ns, entry.sha1) is None:
            report.problems.append(Problem(entry.ns, entry.sha1, "orphan",
                                           f"parent {entry.parent} missing or inconsistent"))
    if fix:
        # Deleting an orphan can orphan nothing new: its children are orphans already.
        for problem in report.problems:
            if problem.kind == "orphan" and store.index.get(problem.ns, problem.sha1):
                store.index.remove(problem.ns, problem.sha1)
                os.unlink(store.path(problem.ns, problem.sha1))
                report.fixed += 1
    for ns in store.namespaces():
        for name in os.listdir(store.ns_dir(ns)):
            if name.startswith(".tmp-"):
                report.problems.append(Problem(ns, name, "tmp", "unfinished write"))
                if fix:
                    os.unlink(os.path.join(store.ns_dir(ns), name))
                    report.fixed += 1
    return report
