"""What to save, at which positions, for which reason: the rules as pure code.

ds4-server saves checkpoints on a grid, ``L_k = align_down(k * align - trim, block)``
(2048/32 by default): **cold** after a prompt's prefill, **continued** when the computed
tokens cross a multiple of ``continued_interval``, **evict** when a conversation leaves
the engine, **shutdown** when the server stops. Grid points are where different
conversations meet, so they stay.

Because our files are deltas, a checkpoint where the conversation actually is costs only
its new blocks. With ``tails`` on (the default), cold, evict and shutdown saves also write
a **tail** checkpoint at the block floor of ``n``: the prompt for cold, the computed
tokens (prompt + generated) for evict and shutdown. A tail is not trimmed: ds4 trims so
that a checkpoint ends before the tokens a continuation re-renders differently (the
generation prompt, a closing tag, a BPE merge across the boundary), because its files hit
only whole. Our lookup restores any stored prefix up to the first token that differs, so
an untrimmed tail is never worse than a trimmed one, and reaches the tokens a trimmed one
would leave to prefill (a returned tool call, the end of a reply). A resumed conversation
restores everything the server computed up to the first re-rendered token, less than a
block short at most. With ``tails`` off the rules are exactly ds4's.

Every position is at least ``min_tokens``; cold positions are at most ``cold_max``.

Sliding-window models (``cold_before_last_token``): a file holds the window before its own
end only, so a prompt resent as it is (vLLM computes its last token again, so a hit ends
at ``block_floor(prompt - 1)``) would use a tail at ``block_floor(prompt)`` partly, one
block short of it, where that file's window does not reach. Cold positions are then those
of ``prompt - 1``: the same unless the prompt is a whole number of blocks.
Positions come out ascending, so a tail is planned after (and as a delta on) the grid
checkpoint below it. Pure: no vLLM, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvdisk.core.format import Reason


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


@dataclass(frozen=True, slots=True)
class SaveRules:
    grid: Grid
    min_tokens: int
    cold_max: int
    continued_interval: int
    tails: bool = True
    cold_before_last_token: bool = False

    def positions(self, tokens: int) -> list[int]:
        """Where a checkpoint of the first ``tokens`` computed tokens goes."""
        out = [self.grid.floor(tokens)]
        if self.tails:
            out.append(self.grid.block_floor(tokens))
        return sorted({p for p in out if p >= self.min_tokens and p > 0})

    def on_step(self, prompt_tokens: int, before: int, after: int) -> list[tuple[int, Reason]]:
        """Saves due when a step takes a request's computed tokens from ``before`` to
        ``after`` (a prompt of ``prompt_tokens``)."""
        out: list[tuple[int, Reason]] = []
        if before < prompt_tokens <= after:  # the prefill completes in this step
            last = prompt_tokens - 1 if self.cold_before_last_token else prompt_tokens
            out += [(p, Reason.COLD) for p in self.positions(last) if p <= self.cold_max]
        interval = self.continued_interval
        if after // interval > before // interval:
            frontier = self.grid.floor(after)
            if frontier >= self.min_tokens and all(p != frontier for p, _ in out):
                out.append((frontier, Reason.CONTINUED))
        return sorted(out)

    def on_finished(self, computed: int) -> list[tuple[int, Reason]]:
        """Saves due when a request leaves the engine with ``computed`` tokens in its KV."""
        return [(p, Reason.EVICT) for p in self.positions(computed)]

    def on_shutdown(self, computed: int) -> list[tuple[int, Reason]]:
        """Saves due for a running request when the server is told to stop."""
        return [(p, Reason.SHUTDOWN) for p in self.positions(computed)]
