"""Rank 0's handle on tensor-parallel workers that are Ray actors (`distributed_executor_backend="ray"`).

The same contract as `WorkerProcesses` (distributed/workers.py): start ranks 1..N-1, report when
they are about to join the group, name a failure, stop them. Each worker is an actor pinned to
rank 0's node (a tensor-parallel group stays on one node: its collectives run every layer) that
runs the engine's `serve_rank` — the very function a spawned worker runs — in one remote call;
that call's result says how the rank ended (an exception: its traceback), and a dead actor says
so when its result is asked for.
"""

from __future__ import annotations

from compiled_engine.distributed.process_group import RendezvousAddress
from compiled_engine.distributed.worker_main import ServeRank
from compiled_engine.distributed.workers import (
    FAILURE_GRACE_S,
    JOIN_TIMEOUT_S,
    STOP_TIMEOUT_S,
    TensorParallelWorkerError,
    poll_failure,
)


class TensorParallelActor:
    """One worker rank. Made a Ray actor class by `_actor_class()`."""

    def ping(self) -> int:
        import os

        return os.getpid()

    def serve(self, rank: int, address: RendezvousAddress, serve_rank: ServeRank) -> None:
        serve_rank(rank, address)


def _actor_class():
    import ray

    return ray.remote(TensorParallelActor)


class RayWorkers:
    def __init__(self, world_size: int, address: RendezvousAddress, serve_rank: ServeRank) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from compiled_engine.distributed.ray_cluster import connect_ray, openmp_environment

        connect_ray()
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        env = openmp_environment({})
        self.actors = [
            _actor_class()
            .options(num_cpus=0, scheduling_strategy=here, runtime_env={"env_vars": env})
            .remote()
            for _ in range(1, world_size)
        ]
        self._pings = [actor.ping.remote() for actor in self.actors]
        self._runs = [
            actor.serve.remote(rank, address, serve_rank) for rank, actor in enumerate(self.actors, start=1)
        ]
        self.pids: list[int | None] = [None] * len(self.actors)

    def wait_joining(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Return once every worker actor is up (its `serve` call follows); raise if one fails."""
        import ray

        try:
            self.pids = list(ray.get(self._pings, timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            raise TensorParallelWorkerError(
                f"tensor-parallel worker actors did not start within {timeout_s:.0f} s"
            ) from None
        except ray.exceptions.RayError as exc:
            raise TensorParallelWorkerError(
                f"a tensor-parallel worker actor failed to start: {exc}"
            ) from None

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
            problems.append(
                f"tensor-parallel worker rank {rank} (Ray actor, pid {self.pids[rank - 1]}) {how}"
            )
        return "\n".join(problems) or None

    def wait_for_failure(self, timeout_s: float = FAILURE_GRACE_S) -> str | None:
        return poll_failure(self.failure, timeout_s)

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)

    def stop(self) -> None:
        """Wait for the ranks to leave (after the group told them to), then end the actors."""
        import ray

        ray.wait(self._runs, num_returns=len(self._runs), timeout=STOP_TIMEOUT_S)
        self.kill()
