"""Where a worker's I/O threads run: the plan made from the worker's binding, its engine
process's CPUs and vLLM's binding setting (the threads themselves: test_save_protocol)."""

from __future__ import annotations

from vllm_kvdisk.connector.threads import CpuPlan, bound_cpus, parse_cpus, plan_cpus


def two_nodes(cpu: int) -> int:
    return 0 if cpu < 4 else 1


def test_a_worker_bound_to_its_compute_cores_saves_on_the_spare_ones():
    # This machine's engine_bench: one rank on core 0, core 1 reserved.
    assert plan_cpus({0}, {0, 1}, "auto", node_of=lambda c: 0) == CpuPlan(
        frozenset({1}), frozenset({0, 1})
    )
    # Two NUMA nodes, one rank per node (auto): the spare cores of its own node only.
    assert plan_cpus({0, 1, 2}, set(range(8)), None, node_of=two_nodes) == CpuPlan(
        frozenset({3}), frozenset({0, 1, 2, 3})
    )
    assert plan_cpus({4, 5}, set(range(8)), "auto", node_of=two_nodes).saves == {6, 7}
    # Ranks bound by hand: no rank's compute core is anyone's spare.
    assert plan_cpus({0, 1, 2}, set(range(8)), "0-2|4-6", node_of=two_nodes).saves == {3}
    # NUMA unknown: any spare core.
    assert plan_cpus({0}, {0, 1, 2}, None, node_of=lambda c: None).saves == {1, 2}


def test_workers_with_no_spare_cores_or_no_binding_are_left_alone():
    assert plan_cpus({0}, {0, 1}, "0|1", node_of=lambda c: 0) == CpuPlan()  # TP=2, 2 cores
    assert plan_cpus({0, 1}, {0, 1}, None, node_of=lambda c: 0) == CpuPlan()  # GPU, nobind
    assert plan_cpus(set(), {0, 1}, None) == CpuPlan()
    assert plan_cpus({0, 1, 2}, {0, 1}, None) == CpuPlan()  # not within the engine's CPUs


def test_cpu_lists_are_parsed_or_refused():
    assert parse_cpus("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpus(" 5 ") == {5}
    for bad in ("", "a", "3-1", "0-9999999", "1,,2"):
        assert parse_cpus(bad) is None, bad
    assert bound_cpus("0-1|2-3") == {0, 1, 2, 3}
    for none in (None, "", "auto", "all", "nobind", "0|x"):
        assert bound_cpus(none) is None, none
