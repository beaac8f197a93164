"""Keys and checkpoint positions.

* The rendered text of ``tokens[0:L]`` is the concatenation of each token's bytes, from a
  token -> bytes table built once from the tokenizer. It is raw bytes: a prefix may end in
  the middle of a UTF-8 character, so it is hashed and stored as bytes, never re-encoded.
  A token id the table does not know (padded vocabularies sample them) renders as U+FFFD:
  the text is a name and a preview, identity is always the token ids.
* The key of a checkpoint is the hex SHA1 of that text; its file is ``<sha1>.kv``.
* ds4's grid ``L_k = align_down(k * align - trim, block)`` gives the shared meeting points
  of conversations; tail checkpoints sit at any block boundary (see ``saverules``).
* A namespace isolates everything that makes KV pages incompatible or private: the model
  and its revision, KV dtype, page layout, block size, TP shape, format version, the LoRA
  adapter and the cache salt. Two namespaces never share a file.

Pure: standard library, numpy and xxhash only.
"""

from __future__ import annotations

import array
import hashlib
import json
from dataclasses import asdict, dataclass, replace
from typing import Mapping, Sequence

import numpy as np
import xxhash

from vllm_kvdisk.format import FORMAT_VERSION


def align_down(value: int, multiple: int) -> int:
    return (value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class Grid:
    """The positions where checkpoints may exist, in tokens."""

    align: int
    trim: int
    block_size: int

    def __post_init__(self) -> None:
        if self.align < 1 or self.block_size < 1 or not 0 <= self.trim < self.align:
            raise ValueError(f"invalid checkpoint grid {self}")

    def position(self, k: int) -> int:
        return align_down(k * self.align - self.trim, self.block_size)

    def positions_upto(self, limit: int) -> list[int]:
        """Distinct, increasing, positive grid positions <= limit."""
        out: list[int] = []
        k = 1
        while True:
            pos = self.position(k)
            if pos > limit:
                return out
            if pos > 0 and (not out or pos != out[-1]):
                out.append(pos)
            k += 1

    def floor(self, limit: int) -> int:
        """The deepest grid position <= limit (0 if none)."""
        if limit <= 0:
            return 0
        k = (limit + self.trim) // self.align + 1  # position(k) >= k*align - trim - block
        while k > 0 and self.position(k) > limit:
            k -= 1
        return max(0, self.position(k)) if k > 0 else 0

    def is_position(self, tokens: int) -> bool:
        """Whether ``tokens`` is a grid position."""
        return tokens > 0 and self.floor(tokens) == tokens

    def block_floor(self, tokens: int) -> int:
        return align_down(max(0, tokens), self.block_size)


class TokenTable:
    """token id -> exact bytes, flattened so a prompt renders without a Python loop."""

    __slots__ = ("_blob", "_starts", "_lengths", "_size")

    UNKNOWN = "\ufffd".encode()  # what a detokenizer shows for an id it does not know

    def __init__(self, pieces: Sequence[bytes]):
        # One extra slot at the end renders ids outside the vocabulary.
        pieces = list(pieces) + [self.UNKNOWN]
        self._size = len(pieces) - 1
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        self._lengths = lengths
        self._starts = np.zeros(len(pieces), dtype=np.int64)
        np.cumsum(lengths[:-1], out=self._starts[1:])
        self._blob = np.frombuffer(b"".join(pieces), dtype=np.uint8)

    def __len__(self) -> int:
        return self._size

    def digest(self) -> str:
        """Identity of the vocabulary (what the tool-call log scopes its records by)."""
        h = xxhash.xxh3_128()
        h.update(self._lengths.tobytes())
        h.update(self._blob.tobytes())
        return h.hexdigest()

    def piece(self, token: int) -> bytes:
        token = token if 0 <= token < self._size else self._size
        start = int(self._starts[token])
        return self._blob[start : start + int(self._lengths[token])].tobytes()

    def render(self, tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Text of ``tokens`` and the byte offset where each token ends."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self._size):
            tokens = np.where((tokens < 0) | (tokens >= self._size), self._size, tokens)
        lengths = self._lengths[tokens]
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if tokens.size else 0
        if total == 0:
            return b"", ends
        # Gather variable-length pieces: index = start of its token + offset inside it.
        shift = self._starts[tokens] - (ends - lengths)
        index = np.arange(total, dtype=np.int64) + np.repeat(shift, lengths)
        return self._blob[index].tobytes(), ends


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.uint32, copy=False)
    try:  # array('I') converts a Python list about 4x faster than numpy does
        return np.frombuffer(array.array("I", tokens), dtype=np.uint32)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in 0 .. 2^32-1") from None


def token_digest(tokens: np.ndarray) -> int:
    """xxh3-64 of token ids as little-endian u32: the identity check beside the text key."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(tokens, dtype="<u4").tobytes())


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What must be equal for KV pages to be interchangeable (plus privacy scopes)."""

    model: str
    revision: str
    kv_dtype: str
    layout: str
    block_size: int
    tp_size: int
    tp_rank: int  # the KV shard: ranks that hold equal pages (MLA, replicated heads) share it
    lora: str = ""
    # Only the salt's digest is kept: the salt itself is a secret of its tenant.
    salt_digest: str = ""
    format_version: int = FORMAT_VERSION
    # A pipeline stage holds only its layers: the stage and its layer range. Left out of
    # the identity at PP 1, so a single-stage engine keeps the namespaces it always had.
    pp_size: int = 1
    pp_rank: int = 0
    layers: str = ""

    def canonical(self) -> bytes:
        return json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        return hashlib.sha256(self.canonical()).digest()

    def dirname(self) -> str:
        return self.digest().hex()[:16]

    def describe(self) -> dict[str, object]:
        out = asdict(self)
        if self.pp_size == 1:
            for key in ("pp_size", "pp_rank", "layers"):
                del out[key]
        return out

    def scoped(self, lora: str, salt_digest: str) -> Fingerprint:
        """The namespace of one LoRA adapter and cache salt on this engine."""
        return replace(self, lora=lora, salt_digest=salt_digest)


def rank_group(info: Mapping[str, object]) -> str | None:
    """The rank group of a namespace from what its ``namespace.json`` says: equal for the
    namespaces of all ranks of one engine (TP shards and pipeline stages: everything but
    ``tp_rank``, ``pp_rank`` and ``layers`` equal), None for a single-rank engine or a
    description that is not ours."""
    try:
        if int(info.get("tp_size", 1)) * int(info.get("pp_size", 1)) <= 1:  # type: ignore[call-overload]
            return None
    except (TypeError, ValueError, OverflowError):
        return None
    rest = {k: v for k, v in info.items() if k not in ("tp_rank", "pp_rank", "layers", "digest")}
    body = json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(body).hexdigest()[:16]


def salt_digest(cache_salt: str | None) -> str:
    if not cache_salt:
        return ""
    # surrogatepass: a client's salt may hold a lone surrogate (valid JSON, not UTF-8).
    raw = cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(b"kvdisk-salt\0" + raw).hexdigest()[:32]
