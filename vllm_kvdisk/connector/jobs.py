"""Messages between the two halves of the connector (all plain, picklable dataclasses).

scheduler -> worker: :class:`StepMeta` (loads to start, saves to copy out) once per step.
worker -> scheduler: :class:`WorkerReport` (files written, saves failed, files gone) once
per step, aggregated over TP workers by vLLM.
Only vLLM's two abstract base classes are imported; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_kvdisk.core.entry import Entry
from vllm_kvdisk.core.keys import Scope
from vllm_kvdisk.core.planner import SavePlan


@dataclass(slots=True)
class LoadFile:
    """One file of a chain and the blocks it contributes, ``[start, upto)``."""

    sha1: str
    start: int  # the file's parent_tokens
    upto: int  # restore its blocks up to here (its end, or where the prompt leaves it)
    tokens: int  # the file's own end (checked against its header)
    inode: int = 0  # the file the index saw, in the job's ``indexed_ns`` (0: unknown)
    # Several KV cache groups: per group, the request blocks [a, c) read from this file
    # (a window group's come from the deepest file holding them). Empty: one group,
    # blocks [max(start, the job's start), upto).
    ranges: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class LoadJob:
    req_id: str
    scope: Scope
    files: list[LoadFile]
    start_block: int  # first block index (in the request) to fill; earlier ones are local
    block_ids: list[int]  # engine block ids for request blocks [start_block, ...)
    token_ids: bytes = b""  # u32 LE ids of the prompt up to the hit: every file must hold them
    fail: str | None = None  # set when the scheduler could not plan it: report every block bad
    # Several KV cache groups: per group, the engine block ids of request blocks
    # [start_block, ...) (a window group's skipped blocks are vLLM's null block, never
    # written). Empty: one group, ``block_ids``.
    groups: list[list[int]] = field(default_factory=list)
    # The namespace whose index gave the files' inodes: the scheduler's, TP rank 0's. Every
    # rank runs the job on its own namespace, where a file of the same checkpoint is another
    # file with another inode, so only a file in this namespace is held to them.
    indexed_ns: str = ""


@dataclass(slots=True)
class SaveJob:
    req_id: str
    scope: Scope
    plan: SavePlan
    block_ids: list[int]  # engine block ids of the blocks this file owns
    text: bytes
    token_ids: bytes  # u32 LE ids of the whole prefix
    context_size: int
    tool_map: list[tuple[str, str]] = field(default_factory=list)
    # Several KV cache groups: per group, the engine block ids of the blocks the file
    # stores for it (``Group.placed``). Empty: one group, ``block_ids``.
    groups: list[list[int]] = field(default_factory=list)


@dataclass
class StepMeta(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    step_tokens: int = 0  # tokens this step computes (the worker times prefill steps)
    # Finished requests whose blocks the scheduler holds (delay_free) until the workers
    # name them in finished_sending, once every page copy of theirs is done.
    holds: list[str] = field(default_factory=list)
    # Requests preempted in this step: their blocks are free again, so their copies must
    # be complete before this step's forward may write into them.
    flush: list[str] = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    written: list[Entry] = field(default_factory=list)  # index entries of files that landed
    failed_saves: list[tuple[str, str]] = field(default_factory=list)  # (ns, sha1)
    # Evicted or dropped (journaled): (ns, sha1, inode), the file that went, not a name a
    # file saved again in the same step may hold by now.
    removed: list[tuple[str, str, int]] = field(default_factory=list)
    # A load found it gone or bad: (ns, sha1, inode), the file the index described when
    # the load was planned (0: not known, as on a TP rank's own namespace), not a file
    # saved under the name since.
    stale: list[tuple[str, str, int]] = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)  # req ids whose load fell short
    loads: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds)
    steps: list[tuple[int, float]] = field(default_factory=list)  # (tokens, forward seconds)
    copied: list[str] = field(default_factory=list)  # a req id per save job whose copy ended

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        if isinstance(other, WorkerReport):
            self.written += other.written
            self.failed_saves += other.failed_saves
            self.removed += other.removed
            self.stale += other.stale
            self.failed_loads += other.failed_loads
            self.loads += other.loads
            self.steps += other.steps
            self.copied += other.copied
        return self

    def __bool__(self) -> bool:
        return bool(
            self.written
            or self.failed_saves
            or self.removed
            or self.stale
            or self.failed_loads
            or self.loads
            or self.steps
            or self.copied
        )
