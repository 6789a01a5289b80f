"""Pipeline-parallel hand-offs as opaque custom ops a stage's graph calls (distributed/pipeline_stages.py).

Like the tensor-parallel collectives (kernels/collectives.py): opaque ops with fake impls, so
Dynamo, the passes and Inductor see a call of known output shape, and the call runs
torch.distributed's point-to-point send / recv on the default process group (gloo on CPU, NCCL
on CUDA). A stage's graph receives the previous stage's hidden states where the first stage
embeds, and passes its own on where the last stage would apply the final norm and LM head; the
last stage sends its logits back to the first stage, whose rank samples. The peers' ranks are
constants of each stage's graph (the compile cache keys the stage: graphs/step_graph.py).

Every rank runs every step (the step broadcast of distributed/broadcasting_runner.py), so each
send meets its recv: stage s's TP rank t talks to stage s±1's TP rank t only.

A stage does not wait for what it sends, and the first stage does not wait inside its graph for
the logits: `pp_pass_on` posts the send and the logits' receive and returns the tensor being
received into, so the stage can run its next micro-batch — or its next step — while later stages
run this one. `take_transfers()` hands what a step posted to that step
(graphs/pipeline_step_graph.py), which completes them (`PostedTransfers.wait`) before its logits
are read: each step's transfers on their own, so steps in flight together (the engine core's
pipelined loop) wait only for their own. Point-to-point messages between two ranks arrive in the
order they were posted, so every stage meets each step's hand-offs in step order.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from compiled_engine.kernels.source_version import source_version

PIPELINE_TRANSFER_VERSION = source_version(__name__)


class TransferClock:
    """Seconds this process spent blocked waiting for another stage's data (its stage idle), for
    the per-stage timeline (distributed/pipeline_step_graph.py)."""

    wait_s = 0.0

    @classmethod
    def take(cls) -> float:
        waited, cls.wait_s = cls.wait_s, 0.0
        return waited


# Sends and receives posted and not yet taken by a step (`take_transfers`), with the tensors they
# read or fill (kept alive until they complete), oldest first.
_pending: list[tuple[Any, torch.Tensor]] = []


class PostedTransfers:
    """The sends and receives one step posted, and the tensors they read or fill (kept alive
    until they complete)."""

    def __init__(self, transfers: list[tuple[Any, torch.Tensor]]) -> None:
        self._transfers = transfers

    def wait(self) -> float:
        """Complete them (the first stage: its logits are then filled); returns the seconds spent
        waiting."""
        started = time.perf_counter()
        try:
            for work, _ in self._transfers:
                work.wait()
        finally:
            self._transfers = []
        return time.perf_counter() - started


def take_transfers() -> PostedTransfers:
    """Every send and receive posted since the last call: the step that just ran posted them."""
    taken = _pending[:]
    _pending.clear()
    return PostedTransfers(taken)


def _recv(out: torch.Tensor, src: int) -> None:
    started = time.perf_counter()
    dist.recv(out, src)
    TransferClock.wait_s += time.perf_counter() - started


@torch.library.custom_op("compiled_engine::pp_recv_hidden", mutates_args=())
def pp_recv_hidden(input_ids: torch.Tensor, hidden_size: int, dtype: torch.dtype, src: int) -> torch.Tensor:
    """The previous stage's hidden states [1, T, hidden_size] for this step's T = input_ids.shape[1]."""
    out = torch.empty((1, input_ids.shape[1], hidden_size), dtype=dtype, device=input_ids.device)
    _recv(out, src)
    return out


@pp_recv_hidden.register_fake
def _(input_ids: torch.Tensor, hidden_size: int, dtype: torch.dtype, src: int) -> torch.Tensor:
    return input_ids.new_empty((1, input_ids.shape[1], hidden_size), dtype=dtype)


@torch.library.custom_op("compiled_engine::pp_pass_on", mutates_args=())
def pp_pass_on(
    hidden: torch.Tensor, logits_indices: torch.Tensor, vocab_size: int, dst: int, logits_src: int
) -> torch.Tensor:
    """Post the send of `hidden` [1, T, H] to the next stage (rank `dst`); return this step's
    logits [1, K, vocab_size]: on the first stage the tensor the last stage's (rank `logits_src`)
    are being received into — filled once the step's `PostedTransfers` complete —, zeros on a middle stage
    (`logits_src` -1), whose samples nobody reads."""
    sent = hidden.contiguous().clone()  # the graph may reuse `hidden`'s memory before it is sent
    _pending.append((dist.isend(sent, dst), sent))
    out = hidden.new_empty((1, logits_indices.shape[0], vocab_size))
    if logits_src >= 0:
        _pending.append((dist.irecv(out, logits_src), out))
    else:
        out.zero_()
    return out


@pp_pass_on.register_fake
def _(
    hidden: torch.Tensor, logits_indices: torch.Tensor, vocab_size: int, dst: int, logits_src: int
) -> torch.Tensor:
    return hidden.new_empty((1, logits_indices.shape[0], vocab_size))


@torch.library.custom_op("compiled_engine::pp_send_logits", mutates_args=())
def pp_send_logits(logits: torch.Tensor, dst: int) -> torch.Tensor:
    """The last stage: send its logits to the first stage (rank `dst`) and keep them (a copy: a
    custom op's output may not alias its input)."""
    out = logits.contiguous().clone()
    dist.send(out, dst)
    return out


@pp_send_logits.register_fake
def _(logits: torch.Tensor, dst: int) -> torch.Tensor:
    return torch.empty_like(logits, memory_format=torch.contiguous_format)
