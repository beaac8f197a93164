"""A request's life with the disk cache, as one explicit state and its transitions.

Pure (no vLLM, no torch): the scheduler half holds one :class:`RequestState` per request
and moves it only through these methods, so every rule about when a request may load or
save is here and unit-tested.

    NEW --admitted(load)--> LOADING --load_finished--> RUNNING
     |                         |                          |
     +--admitted(no load)------+                          +--(preempted: back in the queue)
                               |                              may load again
                               +--load_failed (recorded), then load_finished--> FAILED

Invariants:
* A request that has a load job out (``LOADING``) is never offered another one, never
  saves, is not checkpointed at shutdown, and is released by its ``finished_recving``,
  never by ``request_finished``.
* It leaves ``LOADING`` only through the ``finished_recving`` vLLM delivers, which with
  TP > 1 is vLLM's aggregate: every rank has finished its part. A rank's failed load
  arrives earlier (worker reports are forwarded in the step they come) while other ranks
  may still be writing into the blocks: ``load_failed`` only records it, and
  ``load_finished`` applies it.
* A request whose load failed (``FAILED``) is never offered the disk again: vLLM re-queues
  it to recompute the invalid blocks, which looks like a preemption from here. It saves as
  usual once recomputed (a corrupt file's name gets a sound file again).
* A preempted request (``RUNNING``, back in the queue) may load again.
* A request with a page copy not yet confirmed by every worker keeps its blocks past
  ``request_finished`` (``holds_blocks``) until the workers name it in finished_sending:
  copies run after the step that planned them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from vllm_kvdisk.core.control import RequestControl
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.index import Lookup
from vllm_kvdisk.core.keys import Scope
from vllm_kvdisk.core.policy import Decision
from vllm_kvdisk.core.report import CacheReport


class Phase(Enum):
    """Where a request stands with the disk cache."""

    NEW = "new"  # seen, not admitted yet
    LOADING = "loading"  # a load job is out; the request waits for finished_recving
    RUNNING = "running"  # computing (after a load, or without one)
    FAILED = "failed"  # running after a failed load: never offered the disk again


@dataclass(slots=True)
class RequestState:
    request: Any
    scope: Scope
    ns: str
    control: RequestControl
    phase: Phase = Phase.NEW
    memo_key: tuple[int, int] | None = None  # (tokens on the device, usable prompt tokens)
    memo: Lookup | None = None
    memo_ids: np.ndarray | None = None
    declined: Decision | None = None  # the load policy found recomputing cheaper
    copies_out: int = 0  # copy confirmations still due from the workers (one per job each)
    load_error: bool = False  # a rank reported part of the load in flight failed
    # Save positions already computed whose token ids were not known yet (async
    # scheduling): planned at a later step, (length, reason) each.
    deferred: list[tuple[int, Reason]] = field(default_factory=list)
    report: CacheReport | None = None  # what the response says the cache did

    # -- questions ----------------------------------------------------------------------
    @property
    def may_load(self) -> bool:
        return self.phase in (Phase.NEW, Phase.RUNNING)

    @property
    def may_save(self) -> bool:
        return self.phase is not Phase.LOADING

    @property
    def holds_blocks(self) -> bool:
        """Its pages may still be being copied out: the blocks wait for finished_sending."""
        return self.copies_out > 0

    @property
    def computing(self) -> bool:
        """Admitted and computing (a shutdown checkpoints these)."""
        return self.phase in (Phase.RUNNING, Phase.FAILED)

    # -- transitions --------------------------------------------------------------------
    def admitted(self, loading: bool) -> None:
        """vLLM allocated the request's blocks, with external tokens or without."""
        self.memo = self.memo_key = self.memo_ids = None
        self.phase = Phase.LOADING if loading else Phase.RUNNING

    def load_finished(self) -> None:
        """vLLM delivered its ``finished_recving``: every rank's part of the load ended
        (a failed one too), and the request may compute."""
        if self.phase is Phase.LOADING:
            self.phase = Phase.FAILED if self.load_error else Phase.RUNNING
            self.load_error = False

    def load_failed(self) -> None:
        """A rank could not load some of its blocks (vLLM recomputes them). Other ranks
        may still be loading: the request stays ``LOADING`` until ``load_finished``."""
        if self.phase is Phase.LOADING:
            self.load_error = True
