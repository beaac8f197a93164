"""Index scenarios: chains, lookups with reasons, leaf-only eviction."""

import numpy as np

from synth import GRID, byte_table
from vllm_kvdisk.format import Reason
from vllm_kvdisk.index import HALF_LIFE_S, Entry, Index, Miss, score
from vllm_kvdisk.planner import Planner, Prompt


def entry(sha1, tokens, parent=None, parent_tokens=0, size=1000, hits=0, last_used=0, ns="n"):
    return Entry(ns, sha1, tokens, parent, parent_tokens, Reason.COLD, hits, 0, last_used, size, 0)


def test_chain_root_to_leaf_and_broken_links():
    idx = Index()
    idx.add(entry("a", 48))
    idx.add(entry("b", 112, "a", 48))
    idx.add(entry("c", 176, "b", 112))
    assert [e.sha1 for e in idx.chain("n", "c")] == ["a", "b", "c"]
    idx.add(entry("d", 240, "x", 176))  # parent never written
    assert idx.chain("n", "d") is None
    idx.add(entry("e", 240, "b", 176))  # parent ends at 112, not 176
    assert idx.chain("n", "e") is None
    assert idx.total_bytes == 5000


def test_lookup_deepest_hit_and_the_reason_for_the_next_position():
    table = byte_table()
    idx = Index()
    planner = Planner(idx, GRID, min_tokens=1)
    rng = np.random.default_rng(3)
    prompt = Prompt(table, GRID, rng.integers(0, 256, 300))
    for length, ptoks in ((48, 0), (112, 0)):
        key = prompt.key_at(length)
        p_sha = prompt.key_at(ptoks).sha1 if ptoks else None
        idx.add(Entry("n", key.sha1, length, p_sha, ptoks, Reason.COLD, 0, 0, 0, 1, prompt.digest(length)))
    got = planner.lookup("n", prompt, 299)
    assert got.tokens == 112 and got.miss is Miss.NO_CHECKPOINT and got.miss_key.tokens == 240


def test_tokens_differ_reason_with_identical_text_at_the_grid_position():
    # Two ids with the same bytes: same text at every position, different token ids.
    from vllm_kvdisk.keys import TokenTable
    table = TokenTable([bytes([i]) for i in range(256)] + [b"x"])  # id 256 renders like 120
    idx = Index()
    a = Prompt(table, GRID, [120] * 100)
    b = Prompt(table, GRID, [256] + [120] * 99)
    assert a.text == b.text
    idx.add(Entry("n", a.key_at(48).sha1, 48, None, 0, Reason.COLD, 0, 0, 0, 1, a.digest(48)))
    res = Planner(idx, GRID).lookup("n", b, 99)
    assert res.chain == [] and res.miss is Miss.TOKENS_DIFFER and res.miss_key.tokens == 48
    assert Planner(idx, GRID).lookup("n", a, 99).tokens == 48


def test_other_namespace_and_below_min_tokens():
    table = byte_table()
    idx = Index()
    p = Prompt(table, GRID, list(range(100)))
    idx.add(Entry("other", p.key_at(48).sha1, 48, None, 0, Reason.COLD, 0, 0, 0, 1, p.digest(48)))
    res = Planner(idx, GRID).lookup("n", p, 99)
    assert res.miss is Miss.OTHER_NAMESPACE and res.other_namespaces == ("other",)
    assert Planner(idx, GRID, min_tokens=512).lookup("n", p, 99).miss is Miss.BELOW_MIN_TOKENS


def test_plan_save_is_a_delta_on_the_deepest_known_prefix_and_skips_duplicates():
    table = byte_table()
    idx = Index()
    planner = Planner(idx, GRID)
    p = Prompt(table, GRID, list(range(250)))
    first = planner.plan_save("n", p, 112, Reason.COLD)
    assert first.parent is None and first.parent_tokens == 0
    assert planner.reserve(first, p.digest(112), 0)
    assert planner.plan_save("n", p, 112, Reason.EVICT) is None  # in flight: duplicate
    second = planner.plan_save("n", p, 240, Reason.EVICT)
    assert (second.parent, second.parent_tokens) == (first.sha1, 112)  # pending parent counts
    idx.release("n", first.sha1)
    assert planner.plan_save("n", p, 240, Reason.EVICT).parent is None


def test_eviction_takes_leaves_only_lowest_score_first_and_protects():
    idx = Index()
    idx.add(entry("root", 48, size=100))
    idx.add(entry("mid", 112, "root", 48, size=100))
    idx.add(entry("leaf1", 176, "mid", 112, size=100, hits=5, last_used=100))
    idx.add(entry("leaf2", 176, "mid", 112, size=100, hits=0, last_used=50))
    idx.add(entry("lone", 48, size=400))  # low tokens per byte: the cheapest to lose
    plan = idx.plan_eviction(150, now=100)
    assert [e.sha1 for e in plan] == ["lone"]
    plan = idx.plan_eviction(450, now=100, protected=[("n", "lone")])
    assert [e.sha1 for e in plan] == ["leaf2", "leaf1", "mid", "root"]
    # The parent becomes a leaf only after all of its children are planned.
    assert plan.index(next(e for e in plan if e.sha1 == "mid")) > 1


def test_ties_go_to_older_last_use_and_hits_decay():
    idx = Index()
    idx.add(entry("old", 48, last_used=10))
    idx.add(entry("new", 48, last_used=20))
    assert [e.sha1 for e in idx.plan_eviction(1, now=30)] == ["old"]
    hot = entry("hot", 48, hits=8, last_used=0)
    assert score(hot, HALF_LIFE_S) == (4 + 1) * 48 / 1000
