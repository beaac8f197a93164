"""What to load and what to save, decided from token ids alone (no I/O, no vLLM).

:class:`Prompt` is a token sequence with its rendered text on demand (for file names and
contents, never for lookups). :class:`Planner` answers "which chain restores the deepest
prefix" and "which file would a save at L write, on top of which parent"; the scheduler
side of the connector calls it, and the CLI and benchmarks make synthetic checkpoints
the same way. :func:`encode_plan` is the one encoder of a checkpoint file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_kvdisk.core.entry import Entry, head_digest
from vllm_kvdisk.core.format import Reason, window_blocks, window_held
from vllm_kvdisk.core.index import IdsReader, Index, Lookup, Miss, Segment
from vllm_kvdisk.core.keys import as_token_array, token_digest
from vllm_kvdisk.core.tokens import TokenTable


class Prompt:
    """Token ids, with the text of any prefix rendered once on demand."""

    __slots__ = ("ids", "_table", "_text", "_ends")

    def __init__(self, table: TokenTable, tokens: Sequence[int] | np.ndarray):
        self.ids = as_token_array(tokens)
        self._table = table
        self._text: bytes | None = None
        self._ends: np.ndarray | None = None

    def _render(self) -> None:
        if self._text is None:
            self._text, self._ends = self._table.render(self.ids)

    @property
    def text(self) -> bytes:
        self._render()
        return self._text  # type: ignore[return-value]

    def text_upto(self, length: int) -> bytes:
        if not length:
            return b""
        self._render()
        return self._text[: int(self._ends[length - 1])]  # type: ignore[index]

    def sha1_at(self, length: int) -> str:
        """The seed's key: SHA1 of the rendered text of the first ``length`` tokens."""
        return hashlib.sha1(self.text_upto(length)).hexdigest()

    def digest(self, length: int) -> int:
        return token_digest(self.ids[:length])


@dataclass(frozen=True, slots=True)
class SavePlan:
    ns: str
    sha1: str
    tokens: int
    parent: str | None
    parent_tokens: int
    reason: Reason
    # What its window groups leave to the parent's chain (``format.window_held``)
    window_held: int = 0


class Planner:
    def __init__(self, index: Index, block_size: int, read_ids: IdsReader, min_tokens: int = 1):
        self.index = index
        self.block_size = block_size
        self.read_ids = read_ids
        self.min_tokens = min_tokens

    def lookup(
        self,
        ns: str,
        ids: np.ndarray,
        usable: int,
        peers: Callable[[str], bool] | None = None,
    ) -> Lookup:
        """Deepest chain for the prompt ``ids`` ending at most at ``usable`` tokens;
        ``peers``: the namespaces a miss may name (``Index.lookup``)."""
        if usable - usable % self.block_size < self.min_tokens:
            return Lookup(miss=Miss.BELOW_MIN_TOKENS)
        return self.index.lookup(ns, ids, usable, self.block_size, self.read_ids, peers=peers)

    def plan_save(self, ns: str, prompt: Prompt, length: int, reason: Reason) -> SavePlan | None:
        """A save of ``prompt[:length]`` (a block boundary) as a delta on the deepest
        checkpoint on disk or in flight that holds a prefix of it (possibly up to the
        middle of that file), whatever position that one was saved at (a grid point or a
        tail); None when that checkpoint already covers ``length``. So every block of a
        conversation is written once: a conversation's chain is every position it saved
        (and, on a parent that ends where it starts, every sliding-window block too:
        ``window_held``)."""
        if length < self.min_tokens or length % self.block_size or length > len(prompt.ids):
            return None
        below = self.index.lookup(
            ns, prompt.ids, length, self.block_size, self.read_ids, include_pending=True
        )
        if below.tokens >= length:
            return None
        top = below.segments[-1] if below.segments else None
        return SavePlan(
            ns,
            prompt.sha1_at(length),
            length,
            top.entry.sha1 if top else None,
            top.upto if top else 0,
            reason,
            window_held(top.upto, top.entry.tokens) if top else 0,
        )

    def reserve(self, plan: SavePlan, prompt: Prompt, now: int) -> bool:
        """Make a planned save visible to later plans (as a parent, or a duplicate)."""
        ids = prompt.ids[: plan.tokens]
        return self.index.reserve(
            Entry(
                plan.ns,
                plan.sha1,
                plan.tokens,
                plan.parent,
                plan.parent_tokens,
                plan.reason,
                0,
                now,
                now,
                0,
                token_digest(ids),
                head_digest(ids, plan.parent_tokens, self.block_size),
                ids=ids,
            )
        )


def window_files(segments: Sequence[Segment]) -> list[tuple[int, int, int]]:
    """``(tokens, upto, held)`` of each file of a chain, for :func:`window_sources`: a file
    whose parent (the segment before it) ends where the file starts stored its windows
    only from there (``format.window_held``), as its save decided from the same parent."""
    out, parent_end = [], None
    for s in segments:
        e = s.entry
        out.append((e.tokens, s.upto, window_held(e.parent_tokens, parent_end)))
        parent_end = e.tokens
    return out


def window_sources(
    files: Sequence[tuple[int, int, int]], hit: int, local: int, window: int, block_size: int
) -> list[tuple[int, int]] | None:
    """Where the pages of one sliding-window group come from for a hit at ``hit``.

    ``files``: ``(tokens, upto, held)`` of each file of the chain, in order
    (:func:`window_files`: a file's window group holds the window before its own end from
    ``held`` on, ``window_blocks(tokens, window, block, held)``, valid for this prompt
    below ``upto``). The hit needs the blocks ``[skip(hit), hit)`` (vLLM's skipped tokens
    ``hit - window + 1``) that are not held locally (below ``local``). Returns, per file,
    the request blocks ``[a, c)`` read from it (the deepest file that holds a block gives
    it), or None when a needed block is in no file: such a hit cannot be served."""
    bs = block_size
    need_first = max(max(0, hit - window + 1) // bs, local // bs)
    hi = hit // bs
    out = [(0, 0)] * len(files)
    for i in range(len(files) - 1, -1, -1):
        if hi <= need_first:
            break
        tokens, upto, held = files[i]
        first = window_blocks(tokens, window, bs, held)[0]
        a, c = max(first, need_first), min(upto, hit) // bs
        if c < hi or a >= c:
            return None
        out[i] = (a, hi)
        hi = a
    return out if hi <= need_first else None


def trim_to_windows(lookup: Lookup, local: int, windows: Sequence[int], block_size: int) -> Lookup:
    """The deepest part of ``lookup`` whose sliding windows are all stored (or held
    locally): a file used whole always is (from its own pages and its parents'); a prompt
    that leaves a file in its middle is served there only if the window before that point
    is on disk (in that file's own window, or its parents' just below it); otherwise the
    hit steps back, block by block."""
    if not windows or lookup.tokens <= local:  # nothing to load: nothing to trim
        return lookup
    bs = block_size
    for hit in range(lookup.tokens, local, -bs):
        part = lookup if hit == lookup.tokens else lookup.cut_at(hit, Miss.WINDOW_NOT_STORED)
        files = window_files(part.segments)
        if all(window_sources(files, hit, local, w, bs) is not None for w in windows):
            return part
    return lookup.cut(0, Miss.WINDOW_NOT_STORED)


def trim_to_states(lookup: Lookup, local: int) -> Lookup:
    """The deepest part of ``lookup`` that ends where a file ends (a model with a
    recurrent state: a file stores the state after its last token only, so a prompt that
    leaves a file in its middle is served up to that file's parent, whose state is on
    disk, or by the device prefix cache)."""
    if lookup.tokens <= local:  # nothing to load: nothing to trim
        return lookup
    segments = lookup.segments
    for count in range(len(segments), 0, -1):
        last = segments[count - 1]
        if last.upto <= local:
            break
        if last.upto == last.entry.tokens:
            return lookup if count == len(segments) else lookup.cut(count, Miss.STATE_NOT_STORED)
    return lookup.cut(0, Miss.STATE_NOT_STORED)
