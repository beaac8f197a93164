"""Eviction scenarios: leaves only, lowest score first, ties by last use, TP ranks together."""

from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.eviction import HALF_LIFE_S, plan_eviction, score
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.index import Index


def test_eviction_takes_leaves_only_lowest_score_first_and_protects():
    def entry(sha1, tokens, parent=None, parent_tokens=0, size=1000, hits=0, last_used=0):
        return Entry(
            "n", sha1, tokens, parent, parent_tokens, Reason.COLD, hits, 0, last_used, size, 0, 0
        )

    idx = Index()
    idx.add(entry("root", 48, size=100))
    idx.add(entry("mid", 112, "root", 48, size=100))
    idx.add(entry("leaf1", 176, "mid", 112, size=100, hits=5, last_used=100))
    idx.add(entry("leaf2", 176, "mid", 112, size=100, hits=0, last_used=50))
    idx.add(entry("lone", 48, size=400))  # low tokens per byte: the cheapest to lose
    assert [e.sha1 for e in plan_eviction(idx, 150, now=100)] == ["lone"]
    plan = plan_eviction(idx, 450, now=100, protected=[("n", "lone")])
    assert [e.sha1 for e in plan] == ["leaf2", "leaf1", "mid", "root"]
    # A file about to land on top of leaf2 makes leaf2 (and its ancestors) no leaf.
    new = entry("new", 240, "leaf2", 176)
    plan = plan_eviction(idx, 10_000, now=100, adding=[new])
    assert {e.sha1 for e in plan} == {"lone", "leaf1"}


def test_ties_go_to_older_last_use_and_hits_decay():
    idx = Index()
    for name, used in (("old", 10), ("new", 20)):
        idx.add(Entry("n", name, 48, None, 0, Reason.COLD, 0, 0, used, 1000, 0, 0))
    assert [e.sha1 for e in plan_eviction(idx, 1, now=30)] == ["old"]
    hot = Entry("n", "hot", 48, None, 0, Reason.COLD, 8, 0, 0, 1000, 0, 0)
    assert score(hot, HALF_LIFE_S) == (4 + 1) * 48 / 1000


def test_files_of_one_model_go_least_recently_used_first_whatever_their_text_length():
    """Same tokens, sizes a page of text apart, all written within one second: the
    score (tokens per byte) differs by 0.1%, which used to decide, so the newest file
    went first (a full volume then evicted what the next turn needed)."""
    idx = Index()
    sizes = {"first": 3678208, "second": 3682304, "third": 3682304, "newest": 3678208}
    for n, (name, size) in enumerate(sizes.items()):
        idx.add(
            Entry(
                "n",
                name,
                896,
                None,
                0,
                Reason.COLD,
                0,
                100,
                100,
                size,
                0,
                0,
                used_ns=100 * 10**9 + n * 1000,
            )
        )
    three = sizes["first"] + sizes["second"] + sizes["third"]
    plan = plan_eviction(idx, three, now=100)
    assert [e.sha1 for e in plan] == ["first", "second", "third"]
    # A hit still outweighs recency: a used file outlives a newer unused one.
    idx.get("n", "first").hits = 1
    assert [e.sha1 for e in plan_eviction(idx, 1, now=100)] == ["second"]
    # A far better tokens-per-byte (another model) still outweighs recency too.
    idx.add(Entry("m", "dense", 896, None, 0, Reason.COLD, 0, 0, 0, 3678208 // 4, 0, 0))
    assert "dense" not in {e.sha1 for e in plan_eviction(idx, three, now=100)}


def test_a_tp_checkpoint_goes_from_every_rank_where_it_is_a_leaf():
    idx = Index()
    for ns, used in (("r0", 10), ("r1", 30), ("solo", 20)):
        idx.add(Entry(ns, "a", 48, None, 0, Reason.COLD, 0, 0, used, 1000, 0, 0))
    idx.add(Entry("r1", "b", 48, None, 0, Reason.COLD, 0, 0, 40, 1000, 0, 0))
    groups = {"r0": "g", "r1": "g"}
    plan = plan_eviction(idx, 1, now=50, groups=groups)
    assert [e.key for e in plan] == [("r0", "a"), ("r1", "a")]  # r1's copy is newer: still goes
    assert [e.key for e in plan_eviction(idx, 1, now=50)] == [("r0", "a")]  # no groups: alone
    # A sibling that is not a leaf (its rank already continued it), or protected, stays.
    idx.add(Entry("r1", "a2", 112, "a", 48, Reason.COLD, 0, 0, 45, 1000, 0, 0))
    assert [e.key for e in plan_eviction(idx, 1, now=50, groups=groups)] == [("r0", "a")]
    assert ("r1", "b") not in {
        e.key for e in plan_eviction(idx, 3000, now=50, groups=groups, protected=[("r1", "b")])
    }


def test_scores_tie_by_power_of_1_25_bucket_not_by_distance():
    """What DESIGN and the README say: floor(log_1.25 score) decides, so 1.01 and 1.24 tie
    (one bucket) while 1.24 and 1.26, closer together, do not."""
    from vllm_kvdisk.core.eviction import eviction_key

    def bucket(tokens: int) -> int:  # score = tokens / 100 bytes: no hits, used just now
        return eviction_key(
            Entry("n", "x", tokens, None, 0, Reason.COLD, 0, 0, 0, 100, 0, 0), now=0
        )[0]

    assert bucket(101) == bucket(124) != bucket(126)
