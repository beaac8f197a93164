"""Save rules as scenarios: which positions, for which reason (pure, no engine)."""

import pytest

from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.saverules import Grid, SaveRules

COLD, CONT, EVICT, SHUT = Reason.COLD, Reason.CONTINUED, Reason.EVICT, Reason.SHUTDOWN


def rules(tails=True, block=128, **kw) -> SaveRules:
    kw = {"min_tokens": 512, "cold_max": 30000, "continued_interval": 10000, **kw}
    return SaveRules(Grid(2048, 32, block), tails=tails, **kw)


def test_seed_example_grid_only_is_exactly_ds4():
    # ds4: a 10500-token conversation is checkpointed at 10240 - 32 = 10208 (block 16).
    r = rules(tails=False, block=16)
    # The frontier 10000 is crossed too, but its grid position is the same checkpoint:
    # saved once, as cold.
    assert r.on_step(10500, 0, 10500) == [(10208, COLD)]
    assert r.on_finished(10500) == [(10208, EVICT)]
    assert r.on_shutdown(10500) == [(10208, SHUT)]


def test_tails_sit_untrimmed_at_the_block_floor_of_n_after_the_grid_point():
    r = rules(block=128)
    # A 10807-token prompt: grid 10112 (10240 - 32, floored to 128), tail floor(10807) = 10752.
    assert r.on_step(10807, 0, 10807) == [(10112, COLD), (10752, COLD)]
    # prompt + 200 generated tokens: the evict tail covers the reply too.
    assert r.on_finished(11006) == [(10112, EVICT), (10880, EVICT)]
    assert r.on_shutdown(4000) == [(3968, SHUT)]  # grid (4064 floored) and tail coincide
    assert r.on_shutdown(5000) == [(3968, SHUT), (4992, SHUT)]  # not 4864: no trim


def test_no_position_below_min_tokens_and_cold_only_up_to_cold_max():
    r = rules(block=16)
    assert r.on_step(400, 0, 400) == []  # below kv_cache_min_tokens (512)
    assert r.on_step(600, 0, 600) == [(592, COLD)]  # no grid point yet: the tail alone
    assert rules(block=16, cold_max=2000).on_step(2500, 0, 2500) == []
    assert rules(block=16, cold_max=2400).on_step(2500, 0, 2500) == [(2016, COLD)]


def test_cold_only_in_the_step_that_completes_the_prefill():
    r = rules(block=16)
    assert r.on_step(5000, 0, 2048) == []  # a chunk of a longer prefill
    assert r.on_step(5000, 4096, 5000) == [(4064, COLD), (4992, COLD)]
    assert r.on_step(5000, 5000, 5001) == []  # decoding


@pytest.mark.parametrize(
    "before,after,want",
    [
        (9990, 10010, [(8160, CONT)]),  # generation crosses 10000: the grid point below it
        (19999, 20000, [(18400, CONT)]),
        (10010, 10500, []),
    ],
)
def test_continued_frontiers(before, after, want):
    assert rules(block=16, cold_max=1).on_step(5000, before, after) == want


def test_positions_are_ascending_and_distinct():
    r = rules(block=16)
    for n in range(560, 9000, 97):
        got = [p for p, _ in r.on_step(n, 0, n)]
        assert got == sorted(set(got)) and all(p % 16 == 0 and 512 <= p <= n for p in got)
        assert (n // 16) * 16 in got  # the tail, untrimmed
        assert rules(tails=False, block=16).on_step(n, 0, n) == [
            (p, c) for p, c in r.on_step(n, 0, n) if p == r.grid.floor(n)
        ]


def test_window_models_put_the_cold_tail_where_a_resent_prompt_hits():
    """A prompt of whole blocks, resent as it is, hits at one block below its end (vLLM
    computes the last token): a window model's file must end there, since its window
    groups hold only the window before the file's end."""
    window = rules(cold_before_last_token=True)
    assert rules().on_step(2560, 0, 2560) == [(1920, COLD), (2560, COLD)]
    assert window.on_step(2560, 0, 2560) == [(1920, COLD), (2432, COLD)]
    assert window.on_step(2600, 0, 2600) == rules().on_step(2600, 0, 2600)  # not whole blocks
    assert window.on_finished(2591) == rules().on_finished(2591)  # a finished one: unchanged


def test_seed_example_positions():
    # ds4: a 10500-token conversation checkpoints at 10240 - 32 = 10208 tokens.
    assert Grid(2048, 32, 16).floor(10500) == 10208
    # On vLLM's CPU backend (block 128) the same rule lands on the block below.
    assert Grid(2048, 32, 128).floor(10500) == 10112
    assert Grid(2048, 32, 16).positions_upto(6200) == [2016, 4064, 6112]
    assert Grid(2048, 32, 16).floor(2000) == 0


def test_grid_rejects_nonsense():
    with pytest.raises(ValueError):
        Grid(32, 32, 16)
    with pytest.raises(ValueError):
        Grid(64, 8, 0)


def test_positions_are_distinct_when_align_is_below_block():
    assert Grid(64, 8, 128).positions_upto(1000) == [128, 256, 384, 512, 640, 768, 896]


def test_grid_floor_matches_the_positions_and_block_floor():
    grid = Grid(64, 8, 16)
    for limit in range(0, 500):
        positions = grid.positions_upto(limit)
        assert grid.floor(limit) == (positions[-1] if positions else 0)
    assert grid.block_floor(47) == 32 and grid.block_floor(-5) == 0
