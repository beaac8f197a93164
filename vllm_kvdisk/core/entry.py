"""What the index knows of one checkpoint file: its :class:`Entry`, and the keys a lookup
finds it by.

An entry is built from what a scan reads of a file's first bytes, or from what a writer
just encoded (``entry_of``: both give the same entry for the same file). Its ``head``
(xxh3-64 of the ids of its first owned block) is the walk key of the lookup; its
``token_digest`` (xxh3-64 of the ids of its whole prefix) says, without I/O, that a
prompt continues the whole file. (inode, size, mtime) tell the file from another one
given its name later; ``pending`` marks a save in flight, known to save planning only.

Pure: numpy and xxhash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import xxhash

from vllm_kvdisk.core.format import Reason, Summary

Key = tuple[str, str]  # (namespace, sha1)


@dataclass(slots=True)
class Entry:
    ns: str
    sha1: str
    tokens: int  # end: the checkpoint covers token ids [0, tokens)
    parent: str | None
    parent_tokens: int  # start: the file owns blocks [parent_tokens, tokens)
    reason: Reason
    hits: int
    created: int
    last_used: int
    size: int
    token_digest: int  # xxh3-64 of the u32 LE ids [0, tokens)
    head: int  # xxh3-64 of the u32 LE ids of the first owned block
    ids_at: int = 0  # file offset of the stored token ids
    inode: int = 0  # identity of the file on disk, with its size and mtime_ns: a freed
    mtime_ns: int = 0  # inode is reused at once (ext4), so the inode alone is not enough
    pending: bool = False  # a save in flight: no file yet
    used_ns: int = 0  # last use (or the file's mtime) in ns: orders equal scores
    ids: np.ndarray | None = field(default=None, repr=False)  # pending saves: their ids

    @property
    def key(self) -> Key:
        return (self.ns, self.sha1)


def entry_of(
    ns: str, sha1: str, summary: Summary, size: int, inode: int, used_ns: int = 0, mtime_ns: int = 0
) -> Entry:
    """The index entry of a file, from what a scan reads or a writer just encoded
    (``used_ns``: the file's mtime, or the time of the write)."""
    h = summary.header
    return Entry(
        ns,
        sha1,
        h.tokens,
        summary.parent_sha1,
        summary.parent_tokens,
        h.reason,
        h.hits,
        h.created,
        h.last_used,
        size,
        summary.token_digest,
        summary.head,
        summary.ids_at,
        inode,
        mtime_ns,
        used_ns=used_ns,
    )


def head_digest(ids: np.ndarray, start: int, block_size: int) -> int:
    """The walk key of a file starting at ``start``: xxh3-64 of its first block's ids."""
    block = np.ascontiguousarray(ids[start : start + block_size], dtype="<u4")
    return xxhash.xxh3_64_intdigest(block.tobytes())
