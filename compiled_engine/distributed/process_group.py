"""The tensor-parallel process group: rendezvous, the step broadcast, agreeing on numbers.

One torch.distributed group per engine: NCCL for CUDA tensors (the graphs' collectives), gloo
otherwise. Python objects (each step's SchedulerOutput) travel over gloo in both cases: on
CUDA a second, gloo group carries them, so the host never waits on a device stream for them.

The step broadcast is a gloo collective, and gloo's broadcast holds rank 0 until every rank has
joined it. Pipeline stages cannot have that: rank 0 launches step N+1 while stage 1 still runs
step N, and would wait for it. There (`use_posted_broadcasts`, every rank at the same point) rank 0
posts each message to every rank as point-to-point sends instead (tagged apart from the stages'
hand-offs, which share the group on CPU) and goes on; each rank receives them in order.
"""

from __future__ import annotations

import datetime
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Long enough for a rank to compile a bucket graph (CPU Inductor: up to ~20 s) while the others
# wait in a collective. A rank that dies is noticed at once (its sockets close), not after this.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)

# The tag of posted step messages: apart from the pipeline hand-offs' (tag 0) on the same group.
MESSAGE_TAG = 17


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
        self._posted = False
        # Rank 0's posted sends not known to be complete, with the tensors they read.
        self._sends: list[tuple[Any, torch.Tensor]] = []

    def use_posted_broadcasts(self) -> None:
        """From here on `broadcast` posts rank 0's messages as point-to-point sends (see the
        module docstring); every rank must call this at the same point of its message stream."""
        self._posted = True

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj`; every rank returns it."""
        if self._posted:
            return self._post(obj) if self.rank == 0 else self._receive()
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._objects)
        return box[0]

    def _post(self, obj: Any) -> Any:
        self._sends = [(work, tensor) for work, tensor in self._sends if not work.is_completed()]
        data = pickle.dumps(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for dst in range(1, self.world_size):
            for tensor in (size, payload):
                self._sends.append((dist.isend(tensor, dst, group=self._objects, tag=MESSAGE_TAG), tensor))
        return obj

    def _receive(self) -> Any:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, 0, group=self._objects, tag=MESSAGE_TAG)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(payload, 0, group=self._objects, tag=MESSAGE_TAG)
        return pickle.loads(payload.numpy().tobytes())

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
        self._sends.clear()  # the workers received them, or are gone
        if not self._closed and dist.is_initialized():
            dist.destroy_process_group()
        self._closed = True
