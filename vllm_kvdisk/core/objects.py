"""The object tier's pure part: where a checkpoint lives in a bucket, which objects a prompt
could use, and when a replica lists the bucket again (no client, no I/O).

A checkpoint ``ROOT/<ns>/<sha1>.kv`` is the object ``PREFIX/<ns>/<sha1>.kv`` of the
bucket named by ``kv_object_url`` (``s3://BUCKET/PREFIX``): the same name, so an object is
immutable like the file (named by its content) and any replica may write it. A prompt's
candidates are found without an index of the bucket's contents beyond the names: a file
is named by the SHA1 of the rendered text of its prefix, so the names a prompt could use
are the SHA1s of its own text at each block boundary. Keys that are not ``<sha1>.kv``
under a namespace of this prefix are other objects of the bucket, left alone.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from vllm_kvdisk.core.tokens import TokenTable

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_NAME = re.compile(r"^([0-9a-f]{40})\.kv$")

# A listing older than this is made again at the next lookup (in the background).
LIST_EVERY_S = 60.0
# After a lookup the bucket could not serve, a listing at most this often (other replicas'
# uploads of the last minute are found this way without listing on every lookup).
LIST_ON_MISS_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class ObjectUrl:
    """``s3://BUCKET/PREFIX``: the bucket and the key prefix (no slashes at its ends)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> ObjectUrl:
        if not url.startswith("s3://"):
            raise ValueError(f"object store URL must be s3://BUCKET/PREFIX, got {url!r}")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not _BUCKET.match(bucket):
            raise ValueError(f"not an S3 bucket name: {bucket!r}")
        prefix = prefix.strip("/")
        if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise ValueError(f"object key prefix has an empty or dot segment: {prefix!r}")
        return cls(bucket, prefix)

    def ns_prefix(self, ns: str) -> str:
        """The key prefix of one namespace's objects (ends with ``/``)."""
        return f"{self.prefix}/{ns}/" if self.prefix else f"{ns}/"

    def key(self, ns: str, sha1: str) -> str:
        return f"{self.ns_prefix(ns)}{sha1}.kv"

    def name_of(self, ns: str, key: str) -> str | None:
        """The SHA1 a key of ``ns`` names, or None for any other object."""
        head = self.ns_prefix(ns)
        if not key.startswith(head):
            return None
        found = _NAME.match(key[len(head) :])
        return found.group(1) if found else None


def prefix_names(
    table: TokenTable, ids: np.ndarray, block_size: int, upto: int, first: int = 1
) -> list[tuple[int, str]]:
    """``(length, name)`` of every block-aligned prefix of ``ids`` from ``first`` tokens up
    to ``upto``: the names of the files that could hold that prefix (one rendering and one
    pass of SHA1 over the text, however many boundaries)."""
    upto -= upto % block_size
    if upto <= 0:
        return []
    text, ends = table.render(ids[:upto])
    sha = hashlib.sha1()
    done = 0
    out = []
    for length in range(block_size, upto + 1, block_size):
        end = int(ends[length - 1])
        sha.update(text[done:end])
        done = end
        if length >= first:
            out.append((length, sha.copy().hexdigest()))
    return out


def to_fetch(
    names: Iterable[tuple[int, str]],
    remote: set[str],
    is_local: Callable[[str], bool],
    local_hit: int,
) -> list[tuple[int, str]]:
    """The prefixes to download, shallowest first: every remote name of the prompt up to
    the deepest one, except those on the local disk; nothing unless the bucket goes deeper
    than the local hit. (A chain whose parent branches inside another conversation names
    that parent in its file: ``ObjectTier`` fetches it from there.)"""
    mine = [(n, s) for n, s in names if s in remote]
    if not mine or mine[-1][0] <= local_hit:
        return []
    return [(n, s) for n, s in mine if not is_local(s)]


@dataclass(slots=True)
class Listing:
    """What one namespace's objects are, as far as this replica knows: the last listing
    plus its own uploads, and when to list again."""

    names: set[str]
    listed_at: float | None = None  # monotonic seconds of the last listing that ended
    listing: bool = False  # a listing is running

    def due(self, now: float, *, missed: bool) -> bool:
        if self.listing:
            return False
        if self.listed_at is None:
            return True
        age = now - self.listed_at
        return age >= LIST_EVERY_S or (missed and age >= LIST_ON_MISS_EVERY_S)
