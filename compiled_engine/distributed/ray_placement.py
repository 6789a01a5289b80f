"""Where the Ray backend puts the worker ranks: one placement group per pipeline stage.

Pure Python (no Ray import): the plan and the feasibility check are unit-tested without a cluster;
distributed/ray_workers.py turns them into Ray placement groups.

- A stage's tensor-parallel ranks share one node (STRICT_PACK): their collectives run in every layer.
- Stage 0 includes rank 0, the engine's own process (not a Ray actor, or the serving engine's
  actor), so stage 0's other ranks are pinned to rank 0's node (every bundle carries the label
  selector `ray.io/node-id` = that node).
- Any other stage goes to whichever node can hold all of its ranks; different stages may land on
  different nodes (between stages only one hand-off of hidden states per micro-batch travels).
- Resource accounting: each worker rank's bundle claims `CPUS_PER_RANK` CPU, the unit Ray counts
  per core (`ray start --num-cpus`). Rank 0 holds no bundle: it is the process that made the engine
  (a served engine's actor claims its own CPU). GPUs are not claimed (docs/distributed.md: the Ray
  backend runs on CPU only so far).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

CPUS_PER_RANK = 1.0
NODE_ID_LABEL = "ray.io/node-id"


class RayPlacementError(RuntimeError):
    """The Ray cluster cannot hold the engine's worker ranks as asked."""


@dataclass(frozen=True)
class StagePlacement:
    """The worker ranks of pipeline stage `stage`, one bundle each, all on one node; on rank 0's
    node when `on_rank0_node`."""

    stage: int
    ranks: tuple[int, ...]
    bundle: tuple[tuple[str, float], ...]  # the resources of each rank's bundle
    on_rank0_node: bool

    def bundles(self) -> list[dict[str, float]]:
        return [dict(self.bundle) for _ in self.ranks]

    def total(self) -> dict[str, float]:
        return {name: amount * len(self.ranks) for name, amount in self.bundle}

    def describe(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        where = "rank 0's node" if self.on_rank0_node else "one node"
        return (
            f"pipeline stage {self.stage} (worker rank{'s' if len(self.ranks) > 1 else ''} {ranks}): "
            f"{len(self.ranks)} bundle(s) of {dict(self.bundle)} on {where}"
        )


def plan_placement(tensor_parallel_size: int, pipeline_parallel_size: int) -> list[StagePlacement]:
    """One placement per stage that has worker ranks (rank = stage * TP + TP rank; rank 0 is the
    engine's own process, so stage 0 places ranks 1..TP-1 and has no placement when TP = 1)."""
    for name, size in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
    ):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    bundle = (("CPU", CPUS_PER_RANK),)
    plans = []
    for stage in range(pipeline_parallel_size):
        first = stage * tensor_parallel_size
        ranks = tuple(r for r in range(first, first + tensor_parallel_size) if r != 0)
        if ranks:
            plans.append(StagePlacement(stage, ranks, bundle, on_rank0_node=stage == 0))
    return plans


def _holds(resources: Mapping[str, float], needed: Mapping[str, float]) -> bool:
    return all(resources.get(name, 0.0) >= amount for name, amount in needed.items())


def check_feasible(
    plans: list[StagePlacement], node_resources: Mapping[str, Mapping[str, float]], rank0_node: str
) -> None:
    """Refuse at once a stage that no node of the cluster could ever hold (by the nodes' total
    resources, `{node id: {resource: amount}}` of the live nodes); a cluster that could but is busy
    is for the placement group's timeout to name."""
    for plan in plans:
        needed = plan.total()
        if plan.on_rank0_node:
            here = node_resources.get(rank0_node, {})
            if not _holds(here, needed):
                raise RayPlacementError(
                    f"{plan.describe()} cannot be placed: rank 0's node {rank0_node[:12]} has "
                    f"{_summary(here)} in all, and needs {needed} for them (stage 0's ranks share rank "
                    "0's node; give it more CPUs, e.g. `ray start --num-cpus`)"
                )
        elif not any(_holds(resources, needed) for resources in node_resources.values()):
            nodes = "; ".join(f"{node[:12]}: {_summary(r)}" for node, r in node_resources.items())
            raise RayPlacementError(
                f"{plan.describe()} cannot be placed: no node of the cluster has {needed} "
                f"(a stage's tensor-parallel ranks share one node); nodes: {nodes}"
            )


def _summary(resources: Mapping[str, float]) -> str:
    """A node's CPU (and GPU) count, as Ray reports it."""
    counted = {k: resources.get(k, 0.0) for k in ("CPU", "GPU") if k == "CPU" or k in resources}
    return "{" + ", ".join(f"'{k}': {v:g}" for k, v in counted.items()) + "}"
