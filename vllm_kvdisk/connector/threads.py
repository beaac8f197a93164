"""The worker's write threads and how they share the CPU with the engine.

A save's write is background work: no step waits for it. Its threads (encoding, checksums,
the write and fsync, hit-count updates) run at a lower CPU priority than the engine
(``SAVE_NICE`` above the thread that made them; Linux keeps a nice value per thread), so
where the engine keeps the cores busy (vLLM's CPU backend, or an engine process sharing
its cores with the tokenizer and the API server) they take what the engine leaves, and a
decode step is not slowed by a save of the step before. The copy out of the KV cache
keeps the engine's priority: a preempted request's next forward, and every step of a
hybrid model, may wait for it; loads too: a request waits for them.

The GIL is shared too: vLLM's worker loop polls for the next step in Python, and at the
default switch interval (5 ms) an I/O thread waited that long for each turn.

A save that cannot keep up is bounded elsewhere: the staging cap skips it (``busy``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from vllm_kvdisk.core.logs import get_logger

log = get_logger(__name__)

SAVE_NICE = 10  # CFS weight of nice +10 against nice 0: about 1 to 9


def _set_nice(value: int) -> None:
    """Give the calling thread nice ``value``; nothing where the platform has no
    per-thread nice value."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), value)


def save_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads run ``SAVE_NICE`` nicer than the thread making the pool (the
    engine's). Absolute, not relative: a pool's threads are started by whichever thread
    submits first, and inherit its nice value (a copy thread starting write threads)."""
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + SAVE_NICE)
    except (OSError, AttributeError):
        return ThreadPoolExecutor(threads, thread_name_prefix=name)
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=_set_nice,
                              initargs=(nice,))


def shorten_gil_switch(switch_us: int) -> None:
    """Let other threads take the GIL every ``switch_us`` (0: leave it), never slower
    than it is."""
    want = switch_us / 1e6
    if want and want < sys.getswitchinterval():
        log.info("kvdisk: GIL switch interval %.0f -> %.0f us, so I/O threads are not "
                 "starved by the engine loop", sys.getswitchinterval() * 1e6, want * 1e6)
        sys.setswitchinterval(want)
