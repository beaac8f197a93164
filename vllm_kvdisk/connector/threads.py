"""Where the worker's I/O threads run, and how they share the GIL with the engine.

* CPUs. vLLM's CPU backend binds each worker process to the cores its OpenMP threads
  compute on, and keeps some cores of the node out of every rank's list: one for the
  scheduler process and, when a KV connector is configured, one more per rank for the
  connector's transfers (``vllm/utils/ompmultiprocessing.py``; its NIXL connector moves
  its own work there). ``vllm-kvdisk serve`` declines that extra core (the thread count
  would change the engine's bf16 results: :func:`vllm_kvdisk.serve.reserved_cpus`), so
  the spare core is usually the scheduler's. Threads a worker starts inherit its binding,
  so kvdisk's copies, writes and reads all ran on the compute cores while the reserved
  core idled. Now a save's threads run on the spare cores of the node (those of the
  engine process that no rank computes on), and a load's threads on those and the
  worker's own (a request waits for its load: any free core helps). A worker bound to no
  fewer cores than its engine process (GPU workers, ``nobind``), or with none spare,
  leaves its threads where they start.
* The GIL. vLLM's worker loop polls for the next step in Python, and at the default
  switch interval (5 ms) an I/O thread waited that long for each turn.

Pure: standard library.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from dataclasses import dataclass

from vllm_kvdisk.core.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class CpuPlan:
    """CPUs for a save's threads and for a load's (None: leave them where they start)."""

    saves: frozenset[int] | None = None
    loads: frozenset[int] | None = None


def parse_cpus(text: str) -> set[int] | None:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}; None if it is not such a list."""
    cpus: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None:
            return None
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi - lo > 65536:
            return None
        cpus.update(range(lo, hi + 1))
    return cpus


def bound_cpus(bind: str | None) -> set[int] | None:
    """Every rank's compute cores named by ``VLLM_CPU_OMP_THREADS_BIND`` (``"0-3|4-7"``);
    None for ``auto``, ``all``, ``nobind`` or nothing (then one rank per NUMA node)."""
    if not bind or bind.strip() in ("auto", "all", "nobind"):
        return None
    out: set[int] = set()
    for rank in bind.split("|"):
        cpus = parse_cpus(rank)
        if cpus is None:
            return None
        out |= cpus
    return out


def numa_node(cpu: int, sysfs: str = "/sys/devices/system/cpu") -> int | None:
    try:
        names = os.listdir(f"{sysfs}/cpu{cpu}")
    except OSError:
        return None
    nodes = [int(n[4:]) for n in names if re.fullmatch(r"node\d+", n)]
    return nodes[0] if len(nodes) == 1 else None


def plan_cpus(own: set[int], engine: set[int], bind: str | None, node_of=numa_node) -> CpuPlan:
    """Where I/O threads go, for a worker bound to ``own`` under an engine process
    allowed ``engine``."""
    if not own or not own < engine:
        return CpuPlan()
    busy = (bound_cpus(bind) or set()) | own
    nodes = {node_of(cpu) for cpu in own}
    spare = {cpu for cpu in engine - busy if None in nodes or node_of(cpu) in nodes}
    if not spare:
        return CpuPlan()
    return CpuPlan(frozenset(spare), frozenset(spare | own))


def current_plan() -> CpuPlan:
    """The plan for this worker process (its binding is vLLM's by now), logged."""
    try:
        own, engine = os.sched_getaffinity(0), os.sched_getaffinity(os.getppid())
    except (OSError, AttributeError):
        return CpuPlan()
    plan = plan_cpus(set(own), set(engine), os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
    if plan.saves is not None:
        log.info(
            "kvdisk: saves run on CPUs %s, loads on %s (the engine computes on %s)",
            sorted(plan.saves),
            sorted(plan.loads or ()),
            sorted(own),
        )
    return plan


def pin(cpus: frozenset[int] | None) -> None:
    """Bind the calling thread (only it: Linux keeps an affinity per thread) to ``cpus``."""
    if cpus is not None:
        with contextlib.suppress(OSError, AttributeError, ValueError):
            os.sched_setaffinity(0, cpus)


def shorten_gil_switch(switch_us: int) -> None:
    """Let other threads take the GIL every ``switch_us`` (0: leave it), never slower
    than it is."""
    want = switch_us / 1e6
    if want and want < sys.getswitchinterval():
        log.info(
            "kvdisk: GIL switch interval %.0f -> %.0f us, so I/O threads are not "
            "starved by the engine loop",
            sys.getswitchinterval() * 1e6,
            want * 1e6,
        )
        sys.setswitchinterval(want)


def usable_cpus() -> int:
    """CPUs this process may run on (its cpuset, e.g. a pod's; the host's count where the
    platform cannot say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
