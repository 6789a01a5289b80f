"""Tensor-parallel collectives as opaque custom ops the graphs call (graphs/passes/tensor_parallel.py).

Opaque ops with fake impls, like the attention ops: Dynamo, the passes and Inductor see a call
with a known output shape, and the call runs torch.distributed's collective on the default
process group (the group the engine's tensor-parallel ranks joined, compiled_engine/distributed/).
The group is the one piece of global state the graphs read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compiled_engine.kernels.source_version import source_version

COLLECTIVES_VERSION = source_version(__name__)

# The group the collectives run on: None is the default group (tensor parallelism alone); under
# pipeline parallelism each stage's tensor-parallel ranks form a group of their own
# (distributed/pipeline_stages.py sets it once, before any graph runs).
_group: dist.ProcessGroup | None = None


def use_tensor_parallel_group(group: dist.ProcessGroup | None) -> None:
    global _group
    _group = group


@torch.library.custom_op("compiled_engine::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over every rank (a new tensor; `x` is left alone)."""
    out = x.clone(memory_format=torch.contiguous_format)  # one copy, contiguous for the collective
    dist.all_reduce(out, group=_group)
    return out


@tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("compiled_engine::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dim, in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x, group=_group)
    return torch.cat(parts, dim=-1)


@tp_all_gather.register_fake
def _(x: torch.Tensor, world_size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] * world_size))
