"""Cost-aware loading: restore a prefix only when reading it beats recomputing it.

Loading is not always faster than prefill: a fast GPU with a slow disk recomputes an 8B
model's prefix faster than it can read the KV (REFERENCE: 4.8 GB/s break-even on an H200
against a 1.8 GB/s disk). The model keeps two running estimates, fed by what actually
happens in this engine:
  * load bandwidth (bytes/s), from completed restores;
  * prefill throughput (tokens/s), from engine steps that were mostly prefill.
``choose`` returns how many files of a chain to load. With no measurement yet it loads
(the first restores are what produce the estimate). A store that has been declined for
REPROBE_S is measured again by one full load, so a disk that was slow for a while (a busy
network volume) is not given up on for good. Pure: no I/O, no vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ALPHA = 0.2  # weight of a new sample in the moving averages
MIN_PREFILL_TOKENS = 256  # steps smaller than this say little about prefill speed
REPROBE_S = 300.0  # after declining loads this long, load once to measure the store again


@dataclass(slots=True)
class Estimate:
    value: float = 0.0
    samples: int = 0

    def add(self, sample: float) -> None:
        self.value = sample if not self.samples else (1 - ALPHA) * self.value + ALPHA * sample
        self.samples += 1


@dataclass(slots=True)
class Decision:
    files: int  # how many files of the chain (from its start) to load
    load_s: float
    recompute_s: float
    probe: bool = False  # loading although declined, to measure the store again


class LoadCostModel:
    def __init__(
        self, clock: Callable[[], float] = time.monotonic, reprobe_s: float = REPROBE_S
    ) -> None:
        self.bandwidth = Estimate()  # bytes per second
        self.prefill = Estimate()  # tokens per second
        self.clock = clock
        self.reprobe_s = reprobe_s
        self._last_load = clock()

    def observe_load(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.bandwidth.add(nbytes / seconds)
            self._last_load = self.clock()

    def observe_step(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill.add(tokens / seconds)

    @property
    def ready(self) -> bool:
        return self.bandwidth.samples > 0 and self.prefill.samples > 0

    def choose(self, files: Sequence[tuple[int, int]]) -> Decision:
        """``files``: (bytes to read, tokens it restores) per file, in chain order.
        Loads the longest chain prefix whose load time is below its recompute time."""
        if not self.ready:
            return Decision(len(files), 0.0, 0.0)
        best = Decision(0, 0.0, 0.0)
        load = recompute = 0.0
        for i, (nbytes, tokens) in enumerate(files, start=1):
            load += nbytes / self.bandwidth.value
            recompute += tokens / self.prefill.value
            if load < recompute:
                best = Decision(i, load, recompute)
            elif best.files == 0:
                best = Decision(0, load, recompute)
        if best.files < len(files) and self.clock() - self._last_load >= self.reprobe_s:
            self._last_load = self.clock()  # one probe per period, not one per request
            return Decision(len(files), load, recompute, probe=True)
        return best
