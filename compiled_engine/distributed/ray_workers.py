"""Rank 0's handle on worker ranks that are Ray actors (`distributed_executor_backend="ray"`).

The same contract as `WorkerProcesses` (distributed/workers.py): start ranks 1..N-1, report when
they are about to join the group, name a failure, stop them. The ranks are placed with one Ray
placement group per pipeline stage (distributed/ray_placement.py: a stage's tensor-parallel ranks
on one node, stage 0's on rank 0's node, other stages on any node that holds them), and each is
an actor in its bundle that runs the engine's `serve_rank` — the very function a spawned worker
runs — in one remote call; that call's result says how the rank ended (an exception: its
traceback), and a dead actor says so when its result is asked for. The placement groups are
removed when the workers stop, and when starting them fails.
"""

from __future__ import annotations

import socket
from typing import Any

from compiled_engine.distributed.process_group import RendezvousAddress
from compiled_engine.distributed.ray_placement import (
    NODE_ID_LABEL,
    RayPlacementError,
    StagePlacement,
    check_feasible,
    plan_placement,
)
from compiled_engine.distributed.worker_main import ServeRank
from compiled_engine.distributed.workers import (
    FAILURE_GRACE_S,
    JOIN_TIMEOUT_S,
    STOP_TIMEOUT_S,
    TensorParallelWorkerError,
    poll_failure,
)

# How long a stage's placement group may wait for the cluster to free its resources.
PLACEMENT_TIMEOUT_S = 60.0


class TensorParallelActor:
    """One worker rank. Made a Ray actor class by `_actor_class()`."""

    def where(self) -> tuple[int, str]:
        """This actor's process id and Ray node id."""
        import os

        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def serve(self, rank: int, address: RendezvousAddress, serve_rank: ServeRank) -> None:
        serve_rank(rank, address)


def _actor_class():
    import ray

    return ray.remote(TensorParallelActor)


def ray_rendezvous_address() -> RendezvousAddress:
    """The group's rendezvous on rank 0's node, at the address Ray knows the node by (other
    nodes reach it there; 127.0.0.1 would name their own machine), on a port free on every
    interface of this one."""
    import ray

    from compiled_engine.distributed.ray_cluster import connect_ray

    connect_ray()
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return RendezvousAddress(ray.util.get_node_ip_address(), port)


class RayWorkers:
    def __init__(
        self, world_size: int, tensor_parallel_size: int, address: RendezvousAddress, serve_rank: ServeRank
    ) -> None:
        import ray

        from compiled_engine.distributed.ray_cluster import connect_ray, openmp_environment

        connect_ray()
        self.rank0_node: str = ray.get_runtime_context().get_node_id()
        self.placements = plan_placement(tensor_parallel_size, world_size // tensor_parallel_size)
        self.groups: list[Any] = []
        self.actors: list[Any] = []  # rank r's actor at index r - 1
        self._runs: list[Any] = []
        self.pids: list[int | None] = [None] * (world_size - 1)
        self.node_ids: list[str | None] = [None] * (world_size - 1)  # per worker rank, once joined
        try:
            alive = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
            check_feasible(self.placements, alive, self.rank0_node)
            self.groups = [self._placement_group(plan) for plan in self.placements]
            self._wait_placed()
            env = openmp_environment({})
            by_rank = {}
            for plan, group in zip(self.placements, self.groups, strict=True):
                for bundle, rank in enumerate(plan.ranks):
                    by_rank[rank] = self._start_actor(plan, group, bundle, env)
            self.actors = [by_rank[rank] for rank in range(1, world_size)]
        except BaseException:
            self.kill()
            raise
        self._wheres = [actor.where.remote() for actor in self.actors]
        self._runs = [
            actor.serve.remote(rank, address, serve_rank) for rank, actor in enumerate(self.actors, start=1)
        ]

    def _placement_group(self, plan: StagePlacement) -> Any:
        from ray.util.placement_group import placement_group

        selector = [{NODE_ID_LABEL: self.rank0_node}] * len(plan.ranks) if plan.on_rank0_node else None
        return placement_group(plan.bundles(), strategy="STRICT_PACK", bundle_label_selector=selector)

    def _wait_placed(self) -> None:
        """Every stage's group scheduled, or a clear error naming the first that was not."""
        import time

        import ray

        deadline = time.monotonic() + PLACEMENT_TIMEOUT_S
        for plan, group in zip(self.placements, self.groups, strict=True):
            try:
                ray.get(group.ready(), timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
                raise RayPlacementError(
                    f"{plan.describe()} could not be placed within {PLACEMENT_TIMEOUT_S:.0f} s: the "
                    f"cluster has {free} free now (other work holds the rest, or no single node has "
                    "them free together)"
                ) from None

    @staticmethod
    def _start_actor(plan: StagePlacement, group: Any, bundle: int, env: dict[str, str]) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
        resources = dict(plan.bundle)
        return (
            _actor_class()
            .options(
                num_cpus=resources.get("CPU", 0.0),
                scheduling_strategy=strategy,
                runtime_env={"env_vars": env},
            )
            .remote()
        )

    def wait_joining(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Return once every worker actor is up (its `serve` call follows); raise if one fails."""
        import ray

        try:
            wheres = ray.get(self._wheres, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TensorParallelWorkerError(
                f"tensor-parallel worker actors did not start within {timeout_s:.0f} s"
            ) from None
        except ray.exceptions.RayError as exc:
            raise TensorParallelWorkerError(
                f"a tensor-parallel worker actor failed to start: {exc}"
            ) from None
        self.pids = [pid for pid, _ in wheres]
        self.node_ids = [node for _, node in wheres]

    def failure(self) -> str | None:
        """Which worker ranks ended (before rank 0 told them to) and why."""
        import ray

        problems = []
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        for rank, run in enumerate(self._runs, start=1):
            if run not in done:
                continue
            try:
                ray.get(run)
                how = "left"
            except ray.exceptions.RayError as exc:
                how = f"failed:\n{str(exc).rstrip()}"
            node = self.node_ids[rank - 1]
            problems.append(
                f"tensor-parallel worker rank {rank} (Ray actor, pid {self.pids[rank - 1]}, node "
                f"{node[:12] if node else '?'}) {how}"
            )
        return "\n".join(problems) or None

    def wait_for_failure(self, timeout_s: float = FAILURE_GRACE_S) -> str | None:
        return poll_failure(self.failure, timeout_s)

    def kill(self) -> None:
        """End every actor now and release their placement groups. Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for group in self.groups:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - already removed
                pass
        self.actors, self.groups = [], []

    def stop(self) -> None:
        """Wait for the ranks to leave (after the group told them to), then end the actors and
        release their placement groups."""
        import ray

        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=STOP_TIMEOUT_S)
        self.kill()
