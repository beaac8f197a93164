"""Index scenarios: chains, lookups at any block boundary, partial files, pending saves."""

from synth import BLOCK, Disk, ids_of

from vllm_kvdisk.core.entry import Entry, head_digest
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.index import Index, Miss
from vllm_kvdisk.core.keys import token_digest


def spans(lookup):
    return [(s.entry.sha1, s.entry.parent_tokens, s.upto) for s in lookup.segments]


def test_whole_files_are_found_at_any_block_boundary_without_reading_them():
    d = Disk()
    a = ids_of(1)
    d.add("root", a, 48)
    d.add("mid", a, 112, "root", 48)
    d.add("tail", a, 272, "mid", 112)  # not a grid position: any block boundary counts
    got = d.lookup(a, 399)
    assert spans(got) == [("root", 0, 48), ("mid", 48, 112), ("tail", 112, 272)]
    assert got.tokens == 272 and d.reads == 0  # whole files: by token digest, no I/O
    assert got.miss is Miss.NO_CHECKPOINT


def test_the_limit_cuts_a_file_partway_at_its_last_usable_block():
    d = Disk()
    a = ids_of(2)
    d.add("root", a, 48)
    d.add("long", a, 320, "root", 48)
    got = d.lookup(a, 200)  # vLLM always computes the last prompt token itself
    assert spans(got) == [("root", 0, 48), ("long", 48, 192)]
    assert not got.segments[-1].whole


def test_a_sibling_session_gets_the_blocks_it_shares_inside_a_file():
    d = Disk()
    a = ids_of(3)
    d.add("a", a, 320)  # session A: one root file
    b = a.copy()
    b[150:] = ids_of(4)[150:]  # session B diverges at token 150, inside A's file
    got = d.lookup(b)
    assert spans(got) == [("a", 0, 144)]  # up to the last whole block before the divergence
    assert got.miss is Miss.PREFIX_MISMATCH and got.diverged[0].sha1 == "a"
    # B's own checkpoint branches off inside A's file: a chain through A's first 144 tokens.
    d.add("b", b, 304, "a", 144)
    got = d.lookup(b)
    assert spans(got) == [("a", 0, 144), ("b", 144, 304)]
    assert d.index.chain("n", "b") == [d.index.get("n", "a"), d.index.get("n", "b")]
    assert [(s.entry.sha1, s.upto) for s in Index.segments_of(d.index.chain("n", "b"))] == [
        ("a", 144),
        ("b", 304),
    ]
    # ...and A still finds all of its own file.
    assert spans(d.lookup(a)) == [("a", 0, 320)]


def test_divergence_in_the_first_block_is_no_hit_and_a_mismatch():
    d = Disk()
    a = ids_of(5)
    d.add("a", a, 64)
    b = a.copy()
    b[3] += 1
    got = d.lookup(b)
    assert got.segments == [] and got.miss is Miss.NO_CHECKPOINT


def test_same_first_block_two_files_the_deeper_path_wins():
    d = Disk()
    a = ids_of(6)
    d.add("short", a, 64)
    d.add("long", a, 256)  # another replica saved a longer root meanwhile
    d.add("kid", a, 128, "short", 64)
    got = d.lookup(a)
    assert got.tokens == 256 and spans(got) == [("long", 0, 256)]
    assert (
        d.lookup(a, 140).tokens == 128 and len(d.lookup(a, 140).segments) == 1
    )  # fewer files on ties


def test_other_namespace_and_pending_saves():
    d = Disk()
    a = ids_of(7)
    d.add("x", a, 64, ns="other")
    got = d.lookup(a, peers=lambda other: other == "other")
    assert got.miss is Miss.OTHER_NAMESPACE and got.other_namespaces == ("other",)
    # a namespace the caller does not name as a peer (another tenant's) is never compared
    got = d.lookup(a)
    assert got.miss is Miss.NO_CHECKPOINT and got.other_namespaces == ()
    got = d.lookup(a, peers=lambda other: False)
    assert got.miss is Miss.NO_CHECKPOINT and got.other_namespaces == ()
    e = Entry(
        "n",
        "p",
        96,
        None,
        0,
        Reason.COLD,
        0,
        0,
        0,
        0,
        token_digest(a[:96]),
        head_digest(a, 0, BLOCK),
        ids=a[:96],
    )
    assert d.index.reserve(e) and not d.index.reserve(e)
    assert d.lookup(a).tokens == 0  # pending: never a lookup hit
    assert d.lookup(a, include_pending=True).tokens == 96  # but a parent for save planning
    b = a.copy()
    b[40] += 1
    assert d.lookup(b, include_pending=True).tokens == 32  # partly, from its ids in memory
    d.index.release("n", "p")
    assert d.lookup(a, include_pending=True).tokens == 0


def test_replaced_entry_and_removal_keep_the_tables_consistent():
    d = Disk()
    a = ids_of(8)
    d.add("r", a, 64)
    d.add("c", a, 128, "r", 64)
    d.index.remove("n", "r")
    assert d.lookup(a).tokens == 0  # a child whose parent is gone is unreachable
    assert d.index.chain("n", "c") is None
    d.add("r", a, 64)
    assert d.lookup(a).tokens == 128
    assert d.index.total_bytes == 2000 and len(d.index) == 2
    d.add("r", a, 64, size=500)  # the same key again replaces
    assert d.index.total_bytes == 1500 and d.index.namespaces() == ["n"]


def test_hostile_cycles_and_huge_fanout_stay_bounded():
    d = Disk()
    a = ids_of(9)
    for i in range(2000):  # many files share the first block, none continues the prompt
        b = a.copy()
        b[20] = 40000 + i
        d.add(f"f{i}", b, 64)
    got = d.lookup(a)
    assert got.tokens == 16 and d.reads <= 600  # walk steps are capped
    e = Entry("n", "loop", 64, "loop", 32, Reason.COLD, 0, 0, 0, 1, 0, 0)
    d.index.add(e)
    assert d.index.chain("n", "loop") is None
