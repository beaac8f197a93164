"""Keys: what names a checkpoint, and what isolates one namespace from another.

* The key of a checkpoint is the hex SHA1 of the rendered text of its tokens (the token
  table, ``tokens.py``); its file is ``<sha1>.kv``. Identity is always the token ids.
* A namespace isolates everything that makes KV pages incompatible or private: the model
  and its revision, KV dtype, page layout, block size, TP shape, format version, the LoRA
  adapter and the cache salt. Two namespaces never share a file.

Pure: standard library, numpy and xxhash only.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import xxhash

from vllm_kvdisk.core.format import FORMAT_VERSION


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


class Namespaces:
    """An engine's namespaces by privacy scope (LoRA adapter, cache salt digest): the one
    derivation of a scope's fingerprint and directory name. Each half of the connector
    holds one, from its own rank's engine fingerprint (the scheduler's is rank 0's), and
    asks it for every request and job; the digest is computed once per scope."""

    def __init__(self, engine: Fingerprint):
        self.engine = engine
        self._known: dict[tuple[str, str], tuple[Fingerprint, str]] = {}

    def _of(self, lora: str, salt_digest: str) -> tuple[Fingerprint, str]:
        key = (lora, salt_digest)
        found = self._known.get(key)
        if found is None:
            fp = self.engine.scoped(lora, salt_digest)
            found = self._known[key] = (fp, fp.dirname())
        return found

    def fingerprint(self, lora: str, salt_digest: str) -> Fingerprint:
        return self._of(lora, salt_digest)[0]

    def name(self, lora: str, salt_digest: str) -> str:
        return self._of(lora, salt_digest)[1]


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


def salt_digest(cache_salt: str | None, *, key: bytes) -> str:
    """The digest of a cache salt that names its namespace: HMAC-SHA256 keyed with the
    cache directory's secret (``storage/secret.py``), so a guessed salt cannot be
    confirmed from ``namespace.json`` or a directory name by whoever lacks the key."""
    if not cache_salt:
        return ""
    if len(key) < 16:
        raise ValueError("a salt digest needs the cache directory's key")
    # surrogatepass: a client's salt may hold a lone surrogate (valid JSON, not UTF-8).
    raw = cache_salt.encode("utf-8", "surrogatepass")
    return hmac.new(key, b"kvdisk-salt\0" + raw, hashlib.sha256).hexdigest()[:32]


@dataclass(slots=True)
class Scope:
    """The private part of a namespace: LoRA adapter and cache salt (digest only)."""

    lora: str = ""
    salt_digest: str = ""
