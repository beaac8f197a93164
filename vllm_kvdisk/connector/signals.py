"""Learning that vLLM's engine process was told to stop, so running requests can be
checkpointed first (the ``shutdown`` save reason)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any


def on_stop_signal(callback: Callable[[], None]) -> None:
    """Call ``callback`` on SIGTERM or SIGINT, then vLLM's own handler.

    vLLM installs its handlers in the engine process before it builds the scheduler; ours
    is chained in front of them. An in-process engine (default handlers) is left alone:
    its owner's signals are not ours to take; nor is any thread but the main one."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous = signal.getsignal(sig)
            if not callable(previous) or previous is signal.default_int_handler:
                continue

            def handler(signum: int, frame: Any, previous: Any = previous) -> None:
                callback()
                previous(signum, frame)

            signal.signal(sig, handler)
        except ValueError:  # not the main thread
            return
