"""The tensor-parallel process group: rendezvous, the step broadcast, agreeing on numbers.

One torch.distributed group per engine: NCCL for CUDA tensors (the graphs' collectives), gloo
otherwise. Python objects (each step's SchedulerOutput) travel over gloo in both cases: on
CUDA a second, gloo group carries them, so the host never waits on a device stream for them.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Long enough for a rank to compile a bucket graph (CPU Inductor: up to ~20 s) while the others
# wait in a collective. A rank that dies is noticed at once (its sockets close), not after this.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class RendezvousAddress:
    host: str
    port: int

    @classmethod
    def on_localhost(cls) -> RendezvousAddress:
        """A free TCP port on 127.0.0.1: every rank on this machine (the "mp" backend; the Ray
        backend's ranks meet at rank 0's node address: distributed/ray_workers.py)."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return cls("127.0.0.1", probe.getsockname()[1])

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


class TensorParallelGroup:
    """This process's membership (rank `rank` of `world_size`) of the engine's process group."""

    def __init__(self, rank: int, world_size: int, address: RendezvousAddress, device: torch.device) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "tensor_parallel_size > 1 starts its own torch.distributed process group, but this "
                "process already has one (launched by torchrun?); see docs/distributed.md"
            )
        self.rank = rank
        self.world_size = world_size
        self.address = address
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=address.init_method,
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self._objects = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        self._closed = False

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj`; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._objects)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0, group=self._objects)
        return gathered

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks that fit on every device)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._objects)
        return int(tensor.item())

    def close(self) -> None:
        if not self._closed and dist.is_initialized():
            dist.destroy_process_group()
        self._closed = True
