"""Save planning: where a save's parent is, so every block of a conversation is written once."""

import numpy as np
from synth import BLOCK, Disk, ids_of, prompt_of

from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.planner import Planner
from vllm_kvdisk.core.saverules import Grid


def grow(planner, d, prompt, ends, grid, ns="n"):
    """Save every grid point and tail a conversation growing to each of ``ends`` passes;
    returns the tokens each saved file owns."""
    owned = []
    for end in ends:
        for pos in sorted({grid.floor(end), grid.block_floor(end)} - {0}):
            plan = planner.plan_save(ns, prompt, pos, Reason.COLD)
            if plan is not None:
                d.add(plan.sha1, prompt.ids, pos, plan.parent, plan.parent_tokens)
                owned.append(pos - plan.parent_tokens)
    return owned


def test_every_block_of_a_growing_conversation_is_written_once():
    """Tails and grid points share one chain: a grid checkpoint is a delta on the tail
    below it, not a copy of the blocks the tails already hold (1.87x the unique KV on
    an agent's session before), and a lookup still finds the deepest position."""
    grid = Grid(256, 32, BLOCK)
    d = Disk()
    planner = Planner(d.index, BLOCK, d.read)
    prompt = prompt_of(ids_of(10, 2000) % 262)
    owned = grow(planner, d, prompt, range(80, 1800, 80), grid)  # 80 new tokens per turn
    deepest = max(grid.floor(1760), grid.block_floor(1760))
    assert sum(owned) == deepest  # each block once
    got = d.lookup(prompt.ids, 1800)
    assert got.tokens == deepest
    ends = [s.upto for s in got.segments]
    assert [e for e in ends if grid.is_position(e)] == grid.positions_upto(deepest)
    assert len(ends) == len(d.index)  # one chain: no file is a leaf beside it


def test_a_second_conversation_writes_only_where_it_differs():
    """Two sessions share a system prompt and diverge inside a file of the first: the
    second's saves start where the shared prefix ends (a branch inside the file)."""
    grid = Grid(256, 32, BLOCK)
    d = Disk()
    planner = Planner(d.index, BLOCK, d.read)
    first = prompt_of(ids_of(10, 1200) % 262)
    grow(planner, d, first, (600, 1200), grid)
    ids = first.ids.copy()
    ids[700:] = (ids[700:] + 1) % 262  # diverges at token 700, inside a file of the first
    second = prompt_of(ids)
    owned = grow(planner, d, second, (1200,), grid)
    shared = 700 - 700 % BLOCK
    assert sum(owned) == grid.block_floor(1200) - shared


def test_a_save_leaves_the_window_to_a_parent_that_ends_where_it_starts():
    """A delta on a parent that ends at its parent_tokens leaves the window blocks below
    them to the parent's chain (``window_held``); a branch inside a parent cannot (the
    parent's window lies past the branch point), nor a root."""
    d = Disk()
    planner = Planner(d.index, BLOCK, d.read)
    ids = ids_of(3, 400)
    prompt = prompt_of(ids % 262)
    root = planner.plan_save("n", prompt, 128, Reason.COLD)
    assert root.parent is None and root.window_held == 0
    d.add(root.sha1, prompt.ids, 128)
    tail = planner.plan_save("n", prompt, 160, Reason.EVICT)
    assert (tail.parent, tail.parent_tokens, tail.window_held) == (root.sha1, 128, 128)
    # another conversation shares the root's first 64 tokens only: a branch inside it
    other = prompt_of(np.concatenate([ids[:64], ids_of(4, 200)]) % 262)
    branch = planner.plan_save("n", other, 160, Reason.COLD)
    assert (branch.parent, branch.parent_tokens, branch.window_held) == (root.sha1, 64, 0)
