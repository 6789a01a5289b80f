"""The Ray backend's placement plan (distributed/ray_placement.py), without starting Ray: which
worker ranks each stage's placement group holds, and the refusal of a cluster that cannot hold a
stage. The plan on a real Ray cluster is tested in tests/test_pipeline_parallel.py (slow set)."""

from __future__ import annotations

import pytest

from compiled_engine.distributed.ray_placement import (
    CPUS_PER_RANK,
    RayPlacementError,
    check_feasible,
    plan_placement,
)


def _layout(tp: int, pp: int) -> list[tuple[int, tuple[int, ...], bool]]:
    return [(p.stage, p.ranks, p.on_rank0_node) for p in plan_placement(tp, pp)]


def test_each_stage_gets_one_group_of_its_worker_ranks_stage_0_on_rank_0s_node():
    # Rank 0 is the engine's own process: it holds no bundle.
    assert _layout(1, 1) == []
    assert _layout(2, 1) == [(0, (1,), True)]
    assert _layout(1, 2) == [(1, (1,), False)]
    assert _layout(2, 2) == [(0, (1,), True), (1, (2, 3), False)]
    assert _layout(4, 3) == [(0, (1, 2, 3), True), (1, (4, 5, 6, 7), False), (2, (8, 9, 10, 11), False)]
    (stage_1,) = [p for p in plan_placement(2, 2) if p.stage == 1]
    assert stage_1.bundles() == [{"CPU": CPUS_PER_RANK}, {"CPU": CPUS_PER_RANK}]
    assert stage_1.total() == {"CPU": 2 * CPUS_PER_RANK}
    assert (
        stage_1.describe() == "pipeline stage 1 (worker ranks 2, 3): 2 bundle(s) of {'CPU': 1.0} on one node"
    )


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_bad_sizes_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size must be a positive int, got {bad!r}"):
        plan_placement(bad, 2)
    with pytest.raises(ValueError, match=rf"pipeline_parallel_size must be a positive int, got {bad!r}"):
        plan_placement(2, bad)


HEAD, OTHER = "a" * 56, "b" * 56


def test_a_cluster_that_holds_every_stage_passes():
    check_feasible(plan_placement(2, 2), {HEAD: {"CPU": 1.0}, OTHER: {"CPU": 2.0}}, rank0_node=HEAD)
    check_feasible(plan_placement(1, 2), {HEAD: {}, OTHER: {"CPU": 1.0}}, rank0_node=HEAD)
    check_feasible([], {HEAD: {}}, rank0_node=HEAD)


def test_stage_0_needs_room_on_rank_0s_node_not_anywhere():
    # The other node has plenty, but stage 0's ranks must share rank 0's node.
    with pytest.raises(
        RayPlacementError,
        match=r"pipeline stage 0 \(worker rank 1\): 1 bundle\(s\) of \{'CPU': 1.0\} on rank 0's node "
        r"cannot be placed: rank 0's node a{12} has \{'CPU': 0\} in all, and needs \{'CPU': 1.0\}",
    ):
        check_feasible(plan_placement(2, 2), {HEAD: {}, OTHER: {"CPU": 8.0}}, rank0_node=HEAD)


def test_a_stage_no_single_node_can_hold_is_refused_naming_the_stage_and_the_nodes():
    # 3 CPUs free across the two nodes, but stage 1's two ranks must share one node.
    with pytest.raises(
        RayPlacementError,
        match=r"pipeline stage 1 \(worker ranks 2, 3\).* cannot be placed: no node of the cluster has "
        r"\{'CPU': 2.0\} \(a stage's tensor-parallel ranks share one node\); nodes: a{12}: \{'CPU': 1\}; "
        r"b{12}: \{'CPU': 1\}",
    ):
        check_feasible(plan_placement(2, 2), {HEAD: {"CPU": 1.0}, OTHER: {"CPU": 1.0}}, rank0_node=HEAD)
