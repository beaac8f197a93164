"""Save planning: where a save's parent is, so chains stay shallow as a conversation grows."""

from synth import BLOCK, Disk, ids_of

from vllm_kvdisk.core.format import Reason


def test_grid_saves_rebase_on_the_grid_so_chains_stay_shallow():
    """A conversation growing turn by turn: tails chain on each other between grid points,
    and each grid checkpoint is a delta on the previous grid checkpoint, not on the tails,
    so the chain is the grid points plus the tails since the last one."""
    from synth import prompt_of

    from vllm_kvdisk.core.planner import Planner
    from vllm_kvdisk.core.saverules import Grid

    grid = Grid(256, 32, BLOCK)
    d = Disk()
    planner = Planner(d.index, BLOCK, d.read)
    ids = ids_of(10, 2000)
    prompt = prompt_of(ids % 262)
    ids = prompt.ids
    for end in range(80, 1800, 80):  # 80 new tokens per turn
        for pos in sorted({grid.floor(end), grid.block_floor(end)} - {0}):
            plan = planner.plan_save(
                "n",
                prompt,
                pos,
                Reason.COLD,
                spine=grid.is_position if grid.is_position(pos) else None,
            )
            if plan is not None:
                d.add(plan.sha1, ids, pos, plan.parent, plan.parent_tokens)
    got = d.lookup(ids, 1800)
    ends = [s.upto for s in got.segments]
    assert got.tokens == max(grid.floor(1760), grid.block_floor(1760))
    on_grid = [e for e in ends if grid.is_position(e)]
    assert on_grid == grid.positions_upto(got.tokens)  # every grid point, in order
    assert len(ends) - len(on_grid) <= 256 // 80 + 1  # only the tails since the last one
    assert len(d.index) > len(ends)  # the superseded tails are still there, as leaves
