"""Worker halves on host tensors, for the tests that drive one without an engine: one way
to build one, to hand it a save, and to describe a load."""

from __future__ import annotations

import hashlib

import numpy as np

from vllm_kvdisk.connector.jobs import LoadFile, LoadJob, SaveJob, Scope, StepMeta
from vllm_kvdisk.connector.worker import WorkerSide
from vllm_kvdisk.core.compat import Placement
from vllm_kvdisk.core.config import load_config
from vllm_kvdisk.core.format import Reason
from vllm_kvdisk.core.keys import Fingerprint
from vllm_kvdisk.core.planner import SavePlan

BLOCK = 16


def fingerprint(block: int = BLOCK) -> Fingerprint:
    return Fingerprint("m", "0", "float32", "cpu:test/1", block, 1, 0)


FP = fingerprint()


def make_worker(
    tmp_path,
    caches: dict | None,
    *,
    block: int = BLOCK,
    fp: Fingerprint | None = None,
    placement: Placement | None = None,
    name: str = "kv",
    **config,
) -> WorkerSide:
    """A worker on ``tmp_path/name`` (no free-space floor), its caches registered unless
    ``caches`` is None; ``config`` adds or overrides config keys."""
    cfg = load_config(
        {
            "kv_disk_dir": str(tmp_path / name),
            "kv_disk_min_free_mb": 0,
            "kv_disk_io_threads": 3,
            **config,
        }
    )
    w = WorkerSide(cfg, fp or fingerprint(block), block, placement or Placement())
    if caches is not None:
        w.register_kv_caches(caches)
    return w


def save_job(
    ids: np.ndarray,
    blocks: list[int],
    *,
    block: int = BLOCK,
    start: int = 0,
    parent: str | None = None,
    text: bytes | None = None,
    req: str = "r",
    ns: str | None = None,
) -> SaveJob:
    """The save of request blocks [start/block, ...) held in engine blocks ``blocks``; its
    text is ``text`` or ``tokens`` bytes of "t" (the name is the text's SHA1)."""
    tokens = start + len(blocks) * block
    if text is None:
        text = b"t" * tokens
    plan = SavePlan(
        ns or fingerprint(block).dirname(),
        hashlib.sha1(text).hexdigest(),
        tokens,
        parent,
        start,
        Reason.COLD,
    )
    return SaveJob(req, Scope(), plan, blocks, text, ids[:tokens].tobytes(), 4096)


def save(w: WorkerSide, job: SaveJob) -> str:
    """Hand ``job`` to the worker, wait for its write, and fail unless it was written."""
    w.wait_for_save(StepMeta(saves=[job]))
    w.drain()
    report = w.build_connector_worker_meta()
    if report is None or job.plan.sha1 not in [e.sha1 for e in report.written]:
        raise AssertionError(f"save failed: {report}")
    return job.plan.sha1


def load_job(
    ids: np.ndarray, files: list[LoadFile], start_block: int, targets: list[int]
) -> LoadJob:
    """A load of ``files`` into engine blocks ``targets``, the prompt's ids up to the hit."""
    return LoadJob("r", Scope(), files, start_block, targets, ids[: files[-1].upto].tobytes())
