"""Loggers that come out through vLLM's logging, in every vLLM process.

vLLM configures one logger, ``vllm`` (its handler, format and level), separately in the
API server, the engine process and each worker, and resets the children of ``vllm`` each
time. A logger named ``vllm.kvdisk.<module>`` with nothing set on it propagates to that
logger, so the cache's lines get vLLM's time, level, process name and pid wherever they
are logged, and follow ``VLLM_LOGGING_LEVEL``. Outside vLLM (the ``kvdisk`` tool) they
fall through to Python's default handling.
"""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    """The logger of one of our modules (pass ``__name__``)."""
    return logging.getLogger("vllm.kvdisk." + module.removeprefix("vllm_kvdisk."))
