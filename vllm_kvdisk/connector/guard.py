"""The error policy of the connector's hooks: the engine never dies of the cache.

A guarded hook that raises is counted (``errors{hook}``), logged with its traceback, and
answers its neutral value (no match, no load, an empty step message): the request is
served as if the cache were absent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from vllm_kvdisk.core.logs import get_logger

log = get_logger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def guarded(hook: str, default: Callable[[], Any]) -> Callable[[F], F]:
    """Run a connector hook; on any exception count it (``errors{hook}`` on the object's
    ``stats``), log it, and return ``default()`` (a neutral value of the hook's type)."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception:  # noqa: BLE001
                self.stats.count("errors", hook)
                log.exception("kvdisk: %s failed; serving without the disk cache", hook)
                return default()

        return cast(F, run)

    return wrap
