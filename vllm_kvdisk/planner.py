"""What to load and what to save, decided from token ids alone (no I/O, no vLLM).

A :class:`Prompt` renders a token sequence once (text, per-token byte ends, grid keys);
:class:`Planner` answers "which chain restores the deepest prefix" and "which file would a
save at L write, on top of which parent". The scheduler side of the connector calls it;
the CLI and the benchmarks use it to make synthetic checkpoints the same way.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from vllm_kvdisk.format import Encoded, PageLayout, Payload, Reason, encode_checkpoint
from vllm_kvdisk.index import Entry, Index, Lookup, Miss
from vllm_kvdisk.keys import (Grid, KeyCache, PrefixKey, TokenTable, as_token_array,
                              prefix_id_digests, token_digest)


class Prompt:
    """A token sequence keyed for lookups: the SHA1 of its text at every grid position.

    With a :class:`KeyCache`, only the part after the deepest grid position seen before
    (the same token ids, recognised by a streaming xxh3-128 of the ids) is rendered and
    hashed: an agent resending a 100k-token conversation pays for its new tokens only.
    The full text is rendered lazily, when a save or a diagnostic needs it.
    """

    __slots__ = ("ids", "keys", "_table", "_digests", "_text", "_ends")

    def __init__(self, table: TokenTable, grid: Grid, tokens: Sequence[int] | np.ndarray,
                 limit: int | None = None, cache: KeyCache | None = None):
        self.ids = as_token_array(tokens)
        self._table = table
        self._digests: dict[int, int] = {}
        self._text: bytes | None = None
        self._ends: np.ndarray | None = None
        n = len(self.ids) if limit is None else min(limit, len(self.ids))
        positions = grid.positions_upto(n)
        self.keys: list[PrefixKey] = []
        ids_digests = prefix_id_digests(self.ids, positions) if cache is not None else []
        state, begin, begin_bytes = None, 0, 0
        for i, pos in enumerate(positions):
            hit = cache.get(ids_digests[i]) if cache is not None else None
            if hit is None:
                break
            sha1_hex, state, begin_bytes = hit
            self.keys.append(PrefixKey(pos, sha1_hex, begin_bytes))
            begin = pos
        todo = positions[len(self.keys):]
        if not todo:
            return
        text, ends = table.render(self.ids[begin:todo[-1]])
        sha = state.copy() if state is not None else hashlib.sha1()
        done = 0
        for i, pos in enumerate(todo, start=len(self.keys)):
            end = int(ends[pos - begin - 1])
            sha.update(text[done:end])
            done = end
            key = PrefixKey(pos, sha.hexdigest(), begin_bytes + end)
            self.keys.append(key)
            if cache is not None:
                cache.put(ids_digests[i], (key.sha1, sha.copy(), key.text_end))

    def _render(self) -> None:
        if self._text is None:
            self._text, self._ends = self._table.render(self.ids)

    @property
    def text(self) -> bytes:
        self._render()
        return self._text  # type: ignore[return-value]

    def digest(self, length: int) -> int:
        if length not in self._digests:
            self._digests[length] = token_digest(self.ids[:length])
        return self._digests[length]

    def key_at(self, length: int) -> PrefixKey | None:
        for key in self.keys:
            if key.tokens == length:
                return key
        return None

    def text_upto(self, length: int) -> bytes:
        if not length:
            return b""
        self._render()
        return self._text[: int(self._ends[length - 1])]  # type: ignore[index]


@dataclass(frozen=True, slots=True)
class SavePlan:
    ns: str
    sha1: str
    tokens: int
    parent: str | None
    parent_tokens: int
    reason: Reason


class Planner:
    def __init__(self, index: Index, grid: Grid, min_tokens: int = 1):
        self.index = index
        self.grid = grid
        self.min_tokens = min_tokens

    def lookup(self, ns: str, prompt: Prompt, usable: int) -> Lookup:
        """Deepest chain for ``prompt`` ending at most at ``usable`` tokens."""
        keys = [k for k in prompt.keys if k.tokens <= usable]
        if not keys or keys[-1].tokens < self.min_tokens:
            return Lookup(miss=Miss.BELOW_MIN_TOKENS)
        return self.index.lookup(ns, keys, prompt.digest)

    def plan_save(self, ns: str, prompt: Prompt, length: int, reason: Reason) -> SavePlan | None:
        """A save of ``prompt[:length]`` (a grid position) as a delta on the deepest
        checkpoint already on disk or in flight; None when the key is already known."""
        key = prompt.key_at(length)
        if key is None or length < self.min_tokens:
            return None
        if self.index.get(ns, key.sha1) is not None or self.index.pending(ns, key.sha1):
            return None
        below = [k for k in prompt.keys if k.tokens < length]
        parent = self.index.lookup(ns, below, prompt.digest, include_pending=True).chain if below else []
        top = parent[-1] if parent else None
        plan = SavePlan(ns, key.sha1, length, top.sha1 if top else None,
                        top.tokens if top else 0, reason)
        return plan

    def reserve(self, plan: SavePlan, digest: int, now: int) -> bool:
        return self.index.reserve(Entry(plan.ns, plan.sha1, plan.tokens, plan.parent,
                                        plan.parent_tokens, plan.reason, 0, now, now, 0, digest))


def encode_plan(plan: SavePlan, *, text: bytes, ids: np.ndarray, layers: Sequence,
                layout: PageLayout, fingerprint: bytes, kv_dtype: str, context_size: int,
                now: int, tool_map: Sequence[tuple[str, str]] = ()) -> Encoded:
    """Encode the file of ``plan``; ``layers`` hold the pages of blocks it owns."""
    bs = layout.block_size
    tokens = np.ascontiguousarray(ids[: plan.tokens], dtype="<u4")
    payload = Payload(fingerprint, plan.parent, plan.parent_tokens, plan.parent_tokens // bs,
                      (plan.tokens - plan.parent_tokens) // bs, layout, token_digest(tokens))
    return encode_checkpoint(text=text, tokens=tokens.tobytes(), layers=layers, payload=payload,
                             reason=plan.reason, kv_dtype=kv_dtype, context_size=context_size,
                             now=now, tool_map=tool_map)
