"""Mamba / linear-attention states vLLM hands over at block boundaries, kept for saves.

In vLLM's Mamba "align" mode a state is kept only where a prefill step ended on a block
boundary (a chunk's end, the prompt's last whole block; not the boundaries a decode
crosses), and vLLM frees it one step later. It offers each such state to a connector once, in the
step that computes it (``SchedulerOutput.kv_connector_block_state
.boundary_state_offloads``: request, group, block, boundary tokens), without keeping it.

vLLM keeps (with its default ``prefix_cache_retention_interval`` 0) two kinds of
boundary: the prompt's replay boundary and a shared-prefix junction, where a request's
full-attention hit ran past its state hit (``request.shared_prefix_boundary``: the
scheduler ends a chunk there so that siblings sharing the prefix resume from it). A
junction is saved in the step that offers it (``junction``), since the replay boundary
offered a step later replaces its pin.

So per request this keeps the **newest** offered boundary whose every state group was
offered and where a save could be made (the request saves, the boundary is within its
``max_save_tokens``), pinned in vLLM's block pool (``touch``), until a newer one replaces
it, the request is preempted, or it ends: a checkpoint of a state model is made only
there (``boundary``), for any save reason. A pin released after a save was planned on it
is safe: the block goes back to vLLM's free queue in this scheduler step at the earliest,
and nothing writes it before
the next step's ``handle_preemptions``, which waits for the copies of state pages. A save
planned when a request finishes is copied one step later, so that request's pin is
kept until the workers name it in ``finished_sending``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kvdisk.core.format import Group, GroupKind


class StateHandoffs:
    def __init__(self, groups: tuple[Group, ...]):
        self.state_groups = tuple(i for i, g in enumerate(groups) if g.kind == GroupKind.STATE)
        self.pool: Any = None  # vLLM's block pool (bind_kv_cache_manager)
        self._newest: dict[str, tuple[int, dict[int, Any]]] = {}  # req -> (tokens, blocks)
        self._after_finish: dict[str, list[Any]] = {}  # req -> pins until finished_sending

    @property
    def active(self) -> bool:
        return bool(self.state_groups)

    def take(self, scheduler_output: Any, wanted: Callable[[str, int], bool]) -> list[str]:
        """Pin, per request, the newest whole boundary offered this step that ``wanted``
        accepts (``wanted(req_id, tokens)``: a save could be made there), releasing the
        one it replaces. The requests pinned anew this step, in offer order."""
        pinned: list[str] = []
        if not self.active or self.pool is None:
            return pinned
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(state, "boundary_state_offloads", None) or {}
        for req_id, entries in offers.items():
            by_boundary: dict[int, dict[int, int]] = {}
            for group, block_id, tokens in entries:
                if group in self.state_groups and block_id:
                    by_boundary.setdefault(int(tokens), {})[int(group)] = int(block_id)
            whole = [
                t
                for t, blocks in by_boundary.items()
                if len(blocks) == len(self.state_groups) and wanted(req_id, t)
            ]
            if not whole:
                continue
            tokens = max(whole)
            old = self._newest.get(req_id)
            if old is not None and old[0] >= tokens:
                continue
            blocks = {g: self.pool.blocks[b] for g, b in by_boundary[tokens].items()}
            self.pool.touch(list(blocks.values()))
            self._newest[req_id] = (tokens, blocks)
            pinned.append(req_id)
            if old is not None:
                self.pool.free_blocks(list(old[1].values()))
        return pinned

    def boundary(self, req_id: str) -> tuple[int, dict[int, int]] | None:
        """The newest state boundary pinned for a request: (tokens, group -> block id)."""
        found = self._newest.get(req_id)
        if found is None:
            return None
        return found[0], {g: b.block_id for g, b in found[1].items()}

    def junction(self, req_id: str, request: Any) -> int:
        """The request's pinned boundary when it is the shared-prefix junction vLLM kept
        for it, else 0."""
        found = self._newest.get(req_id)
        at = int(getattr(request, "shared_prefix_boundary", 0) or 0)
        return found[0] if found is not None and at > 0 and found[0] == at else 0

    def finished(self, req_id: str, saving: bool) -> None:
        """A request left the engine: its pin goes now, or, when a save of it was just
        planned (copied in a later step), once ``released`` names it."""
        found = self._newest.pop(req_id, None)
        if found is None:
            return
        if saving:
            self._after_finish[req_id] = list(found[1].values())
        else:
            self.pool.free_blocks(list(found[1].values()))

    def preempted(self, req_ids: Any) -> None:
        """vLLM preempted these requests: their pins go now (a preempted request waits,
        maybe long, and computes its states again when it resumes). Safe for a copy
        still running: the workers finish a preempted request's copies before the step's
        forward (``flush``), and the block is allocated again at the next step at the
        earliest."""
        for req_id in req_ids or ():
            self.finished(req_id, saving=False)

    def released(self, req_ids: Any) -> None:
        """The workers gave these finished requests' blocks back (``finished_sending``)."""
        for req_id in req_ids or ():
            blocks = self._after_finish.pop(req_id, None)
            if blocks:
                self.pool.free_blocks(blocks)

    @property
    def pinned(self) -> int:
        """Blocks pinned now (running requests' newest boundaries and finished ones')."""
        return sum(len(b) for _, b in self._newest.values()) + sum(
            len(b) for b in self._after_finish.values()
        )
