"""Per KV cache group, which engine blocks a load fills and a save stores (hybrid models).

A full-attention group's blocks are the file's own, ``[parent_tokens, tokens)``; a
sliding-window group's are only the window a hit at the file's end needs
(``format.window_blocks``), less what its parent's chain holds (``format.window_held``);
a state group's is one block, the state after the file's last token: a save takes it
from the block vLLM handed over for that boundary (``states``), a load puts the last
file's into the request's block of the hit (``format.state_block``). vLLM's null block
stands where a window has moved on: a load never fills it, and a save whose window is
partly gone is not made.
"""

from __future__ import annotations

from typing import Any

from vllm_kvdisk.connector.jobs import LoadJob
from vllm_kvdisk.core.format import Group, GroupKind, is_hybrid, state_block, window_blocks
from vllm_kvdisk.core.planner import window_files, window_sources


class GroupBlocks:
    def __init__(self, groups: tuple[Group, ...], block_size: int):
        self.groups = groups
        self.block_size = block_size
        self.windows = [g.window for g in groups if g.kind == GroupKind.WINDOW]
        self.hybrid = is_hybrid(groups)
        self.null_block = 0  # vLLM's null block (skipped window blocks): from the manager

    def main(self, all_ids: Any) -> list[int]:
        """The block table of the first attention group (a state group's table is mostly
        vLLM's null block): what a load's and a save's block count is checked against."""
        for group, ids in zip(self.groups, all_ids):
            if group.kind != GroupKind.STATE:
                return list(ids)
        return list(all_ids[0]) if len(all_ids) else []

    def place(self, job: LoadJob, segments: list, all_ids: Any, local: int, hit: int) -> None:
        """Per group, the engine blocks to fill and which file fills which: a full group's
        from every file it owns, a window group's only the window before the hit (vLLM's
        null block below it), each block from the deepest file holding it."""
        bs, start, end = self.block_size, job.start_block, hit // self.block_size
        if len(all_ids) != len(self.groups):
            raise ValueError(f"{len(all_ids)} block tables for {len(self.groups)} KV cache groups")
        job.groups = [list(ids[start:end]) for ids in all_ids]
        files = window_files(segments)
        per_group = []
        for group, ids in zip(self.groups, job.groups):
            if group.kind == GroupKind.STATE:  # the state at the hit: the last file's
                last = segments[-1] if segments else None
                if last is None or last.upto != hit or last.entry.tokens != hit:
                    raise ValueError("the hit does not end where a file's state is stored")
                p = state_block(hit, bs)
                sources = [(0, 0)] * (len(segments) - 1) + [(p, p + 1)]
            elif group.kind == GroupKind.WINDOW:
                found = window_sources(files, hit, local, group.window, bs)
                if found is None:
                    raise ValueError("a sliding window the hit needs is not stored")
                sources = found
            else:
                sources = [
                    (max(s.entry.parent_tokens // bs, start), s.upto // bs) for s in segments
                ]
            for a, c in sources:
                if self.null_block in ids[a - start : c - start]:
                    raise ValueError("a block to restore is vLLM's null block")
            per_group.append(sources)
        for i, file in enumerate(job.files):
            file.ranges = tuple(sources[i] for sources in per_group)
        if end - start != len(job.block_ids):
            raise ValueError("fewer blocks allocated than the hit covers")

    def stored(
        self,
        group_ids: list[list[int]],
        parent_tokens: int,
        length: int,
        states: dict[int, int] | None = None,
        window_held: int = 0,
    ) -> list[list[int]] | None:
        """Per group, the engine blocks a file ``[parent_tokens, length)`` stores, or None
        when vLLM has already freed part of a window, or holds no state at ``length``
        (its save cannot be made). ``states``: per state group's index, the block vLLM
        handed over with the state after ``length`` tokens; ``window_held``: the window
        part left to the parent's chain (``format.window_held``)."""
        bs, out = self.block_size, []
        for g, (group, ids) in enumerate(zip(self.groups, group_ids)):
            if group.kind == GroupKind.STATE:
                block = (states or {}).get(g)
                if block is None or block == self.null_block:
                    return None
                out.append([block])
                continue
            if group.kind == GroupKind.WINDOW:
                first, count = window_blocks(length, group.window, bs, window_held)
            else:
                first, count = parent_tokens // bs, (length - parent_tokens) // bs
            part = list(ids[first : first + count])
            if len(part) != count or self.null_block in part:
                return None
            out.append(part)
        return out
