"""What a server may write: a cap on bytes per day (SSD wear) and an admission rule.

:class:`WriteBudget` is a bucket that holds at most one day's bytes and refills
continuously (1/86,400 of the cap each second); a save is admitted while the bucket is not
empty and is charged with the bytes of the files it wrote (every rank's), once they landed.
So over any day the bytes written stay within the cap plus one save. It starts full: a
restart refills it (the cap is per server process). :class:`Admission` decides which
requests are written at all: ``all``, or ``repeat``, only a request whose first block an
earlier request of its namespace started with too, so a one-off prompt is never written
and a conversation is from its second turn on (its first turn's blocks are still in the
device cache then, and the second turn's saves start at token 0). Pure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from vllm_kvdisk.core.config import ADMISSION_RULES

DAY_S = 86400.0
SEEN_MAX = 65536  # first blocks remembered for ``repeat`` (LRU)


class WriteBudget:
    def __init__(self, bytes_per_day: int, now: float):
        self.cap = float(bytes_per_day)
        self.level = self.cap
        self._at = now

    @property
    def capped(self) -> bool:
        return self.cap > 0

    def _refill(self, now: float) -> None:
        if now > self._at:
            self.level = min(self.cap, self.level + (now - self._at) * self.cap / DAY_S)
        self._at = max(self._at, now)

    def allows(self, now: float) -> bool:
        """Whether a save may be planned now (always, without a cap)."""
        if not self.capped:
            return True
        self._refill(now)
        return self.level > 0

    def charge(self, nbytes: int, now: float) -> None:
        """Bytes that landed on disk (the level may go below zero by one save)."""
        if self.capped:
            self._refill(now)
            self.level -= nbytes

    def left(self, now: float) -> int:
        if not self.capped:
            return 0
        self._refill(now)
        return max(0, int(self.level))


class Admission:
    def __init__(self, rule: str, seen_max: int = SEEN_MAX):
        if rule not in ADMISSION_RULES:
            raise ValueError(f"unknown admission rule {rule!r}")
        self.rule = rule
        self._seen: OrderedDict[Hashable, str] = OrderedDict()
        self._max = seen_max

    def admits(self, start: Hashable, req_id: str) -> bool:
        """Whether request ``req_id``, whose first block is ``start`` (namespace and ids),
        is written. The same request asking again is not an earlier one."""
        if self.rule == "all":
            return True
        first = self._seen.get(start)
        if first is None:
            self._seen[start] = req_id
            if len(self._seen) > self._max:
                self._seen.popitem(last=False)
            return False
        self._seen.move_to_end(start)
        return first != req_id
