"""An engine's tensor-parallel state: its rank's layout, the group, and (rank 0) the workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compiled_engine.distributed.process_group import RendezvousAddress, TensorParallelGroup
from compiled_engine.distributed.workers import WorkerProcesses

if TYPE_CHECKING:
    from compiled_engine.engine_args import EngineArgs


@dataclass
class TensorParallelRuntime:
    rank: int
    world_size: int
    group: TensorParallelGroup
    workers: WorkerProcesses | None  # rank 0 only

    @classmethod
    def start(
        cls,
        world_size: int,
        device: torch.device,
        engine_args: EngineArgs,
        rank_and_address: tuple[int, RendezvousAddress] | None,
    ) -> TensorParallelRuntime:
        """Rank 0 (`rank_and_address` None): spawn the workers (each builds its rank from
        `engine_args`), then join; a worker: join."""
        if rank_and_address is not None:
            rank, address = rank_and_address
            return cls(rank, world_size, TensorParallelGroup(rank, world_size, address, device), None)
        address = RendezvousAddress.on_localhost()
        workers = WorkerProcesses(world_size, address, engine_args)
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
            for process in self.workers.processes:
                process.kill()
            self.workers.stop()
            self.workers = None
        self.group.close()

    def close(self) -> None:
        """Rank 0: tell the workers to leave, wait for them, leave the group. Idempotent."""
        if self.workers is not None:
            if self.workers.failure() is None:
                try:
                    self.group.broadcast(None)
                except Exception:  # a worker died meanwhile: stop() below still ends the rest
                    pass
            self.workers.stop()
            self.workers = None
        self.group.close()
