"""An engine's tensor-parallel state: its rank's layout, the group, and (rank 0) the workers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_engine.distributed.process_group import RendezvousAddress, TensorParallelGroup
from compiled_engine.distributed.runner_messages import Shutdown
from compiled_engine.distributed.worker_main import ServeRank
from compiled_engine.distributed.workers import WorkerProcesses, Workers


@dataclass
class TensorParallelRuntime:
    rank: int
    world_size: int
    group: TensorParallelGroup
    workers: Workers | None  # rank 0 only

    @classmethod
    def start(
        cls,
        world_size: int,
        device: torch.device,
        serve_rank: ServeRank,
        rank_and_address: tuple[int, RendezvousAddress] | None,
        launcher: str = "mp",
        tensor_parallel_size: int | None = None,
    ) -> TensorParallelRuntime:
        """Rank 0 (`rank_and_address` None): start the workers — spawned processes on this
        machine ("mp"), or Ray actors placed stage by stage ("ray", distributed/ray_workers.py;
        `tensor_parallel_size` ranks per stage, all of them when None) — then join; a worker: join.

        Each worker runs `serve_rank`, which the engine provides: it builds the worker's rank
        with the engine's own constructor, so the runtime needs to know nothing of the engine.
        """
        if rank_and_address is not None:
            rank, address = rank_and_address
            return cls(rank, world_size, TensorParallelGroup(rank, world_size, address, device), None)
        workers: Workers
        if launcher == "ray":
            from compiled_engine.distributed.ray_workers import RayWorkers, ray_rendezvous_address

            # Reachable from the other nodes: the address Ray knows rank 0's node by.
            address = ray_rendezvous_address()
            workers = RayWorkers(world_size, tensor_parallel_size or world_size, address, serve_rank)
        else:
            address = RendezvousAddress.on_localhost()
            workers = WorkerProcesses(world_size, address, serve_rank)
        try:
            workers.wait_joining()
            group = TensorParallelGroup(0, world_size, address, device)
        except BaseException:
            workers.stop()
            raise
        return cls(0, world_size, group, workers)

    def abort(self) -> None:
        """Rank 0 failed while building: the workers may sit in any collective, so end them."""
        if self.workers is not None:
            self.workers.kill()
            self.workers.stop()
            self.workers = None
        self.group.close()

    def close(self) -> None:
        """Rank 0: tell the workers to leave, wait for them, leave the group. Idempotent."""
        if self.workers is not None:
            if self.workers.failure() is None:
                try:
                    self.group.broadcast(Shutdown())
                except Exception:  # a worker died meanwhile: stop() below still ends the rest
                    pass
            self.workers.stop()
            self.workers = None
        self.group.close()
