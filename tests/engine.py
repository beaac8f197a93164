"""Test defaults around the shared harness (vllm_kvdisk.testing.harness): a small checkpoint grid,
exact hit counts, an in-process engine and a `vllm-kvdisk serve` server."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from vllm_kvdisk.ops.trace import TraceEvent, read
from vllm_kvdisk.testing import harness
from vllm_kvdisk.testing.harness import free_port, generate, random_prompt, shared_prefix  # noqa: F401

ALIGN = 256  # small grid so tests stay fast: checkpoints at 128, 384, 640, ... (block 128)
# "always": tests assert exact hit counts; the cost-aware default is tested on its own.
# "zstd": every engine test restores compressed pages (auto writes raw files on this
# machine's 2 CPUs); raw files are tested where a test asks for "off".
CFG = {
    "kv_cache_boundary_align_tokens": ALIGN,
    "kv_cache_min_tokens": 128,
    "kv_disk_load_policy": "always",
    "kv_disk_compression": "zstd",
}
# How long a test waits for what background threads do after a request returned (a save's
# write and fsync, a trace line). A guard against a hang, never a verdict: a VM's disk has
# held one fsync for 24 s while the engine's threads kept both cores busy.
OUTCOME_WAIT_S = 300.0
FLAGS = (
    "--kv-cache-boundary-align-tokens",
    str(ALIGN),
    "--kv-cache-min-tokens",
    "128",
    "--kv-disk-load-policy",
    "always",
    "--kv-disk-compression",
    "zstd",
)


@contextlib.contextmanager
def engine(
    model: str,
    kv_dir: str | None,
    *,
    prefix_caching: bool = True,
    llm_args: dict | None = None,
    **extra,
) -> Iterator:
    cfg = {**CFG, **extra} if kv_dir is not None else {}
    with harness.engine(
        model, kv_dir, prefix_caching=prefix_caching, llm_args=llm_args, **cfg
    ) as llm:
        yield llm


class Server(harness.Server):
    """``vllm-kvdisk serve`` in its default multi-process mode, with the test grid."""

    def __init__(
        self,
        model: str,
        kv_dir: str,
        log_path: str,
        *args: str,
        env: dict | None = None,
        dtype: str = "float32",
    ):
        import os

        port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
            **(env or {}),
        }
        env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /reset_prefix_cache
        cmd = harness.kvdisk_command(
            model,
            kv_dir,
            port,
            "--dtype",
            dtype,
            "--max-model-len",
            "8192",
            "--enforce-eager",
            *FLAGS,
            "--shutdown-timeout",
            "20",
            *args,
        )
        super().__init__(cmd, log_path, port, env=env, model=model, timeout_s=240)

    def reset_device_cache(self) -> None:
        self.reset_prefix_cache(external=False)


def events(path: str, kind: str) -> list[TraceEvent]:
    return read(path, [kind])


def wait_until(what: str, done, timeout: float = OUTCOME_WAIT_S) -> None:
    """Poll ``done`` until it is true; a hang guard, never a verdict on how long it took."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.05)


def wait_events(
    path: str, kind: str, count: int = 1, timeout: float = OUTCOME_WAIT_S, where=lambda e: True
) -> list[TraceEvent]:
    """The events of a kind, once at least ``count`` match (explanations and saves are
    written by background threads, shortly after the request returns)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in read(path, [kind]) if where(e)]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def disk_tokens(server: Server) -> float:
    """Prompt tokens the server reports as restored from disk, so far."""
    return server.metric("vllm:prompt_tokens_cached_by_source_total", source="disk")
