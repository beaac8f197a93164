"""The SSD write budget and the admission rule (core/writebudget.py)."""

import pytest

from vllm_kvdisk.core.writebudget import DAY_S, Admission, WriteBudget

MB = 2**20


def test_no_cap_admits_everything_and_reports_nothing_left():
    b = WriteBudget(0, now=0.0)
    b.charge(10**12, now=1.0)
    assert b.allows(now=2.0) and b.left(now=2.0) == 0


def test_the_cap_holds_over_a_day_within_one_save():
    """Saves of 3 MiB offered every second against 100 MiB/day: what is admitted over
    two days stays within two days' cap plus the first day's full bucket and one save."""
    b = WriteBudget(100 * MB, now=0.0)
    written = 0
    t = 0.0
    while t < 2 * DAY_S:
        if b.allows(t):
            b.charge(3 * MB, t)
            written += 3 * MB
        t += 60.0
    assert 2 * 100 * MB <= written <= 3 * 100 * MB + 3 * MB


def test_an_empty_bucket_refills_at_the_cap_per_second():
    b = WriteBudget(int(DAY_S), now=0.0)  # one byte per second
    b.charge(int(DAY_S) + 10, now=0.0)
    assert not b.allows(now=5.0)  # still 5 bytes in debt
    assert b.allows(now=11.0)
    assert b.left(now=11.0 + DAY_S * 3) == int(DAY_S)  # it holds one day at most


def test_repeat_admits_a_start_only_when_another_request_began_with_it():
    a = Admission("repeat", seen_max=2)
    assert not a.admits(("ns", (1, 2)), "r1")
    assert not a.admits(("ns", (1, 2)), "r1")  # the same request again is not a repeat
    assert a.admits(("ns", (1, 2)), "r2")
    assert not a.admits(("other-ns", (1, 2)), "r3")  # per namespace
    assert not a.admits(("ns", (7,)), "r4")
    assert not a.admits(("ns", (8,)), "r5")  # an LRU of 2 starts: newer ones push it out
    assert not a.admits(("ns", (1, 2)), "r6")
    assert Admission("all").admits(("ns", (1,)), "r1")
    with pytest.raises(ValueError):
        Admission("sometimes")
