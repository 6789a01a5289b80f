"""The one general lowered graph of a model's step: traced once, on a synthetic step.

`TracedStep(model, kv_caches, ...)` traces the step through Dynamo (graphs/capture.py, the
capture-time passes included: with `fuse_linears`, weights frozen and q/k/v and gate/up fused
into one GEMM each) on a synthetic step whose T, S, K and block-table width are all different
and >= 2, with duck shaping off, so the one general graph keeps every size as its own symbol
(duck shaping would tie equal example sizes together, and 0/1 sizes would be specialised). The
synthetic step's slot_mapping is all -1: tracing writes only the KV cache's scratch block.

It then freezes the graph's calling convention (graphs/calling_convention.py), read after the
passes: frozen weights are no longer inputs of the traced graph. Every bucket graph
(graphs/bucket_compiler.py) is a variant of this graph, rewritten by the same pass manager's
per-bucket passes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import fx

from compiled_engine.distributed.layout import TensorParallelLayout
from compiled_engine.graphs.calling_convention import CallingConvention
from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.pass_manager import PassManager, PassReport
from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.kernels.backends import AttentionBackend
from compiled_engine.records.weight_quantization import WeightQuantization

_BLOCK_TABLES = "L['inputs'].block_tables"
_KV_CACHE = re.compile(r"L\['kv_caches'\]\[\d+\]")
_WIDTH = "L['inputs'].block_tables.size()[1]"
# The synthetic trace step: every size distinct and >= 2 (see the module docstring).
_TRACE_QUERY_LENS = (4, 5, 4)  # T = 13, S = 3
_TRACE_SAMPLED = (0, 2)  # K = 2
_TRACE_WIDTH = 5
_TRACE_TABLE_STRIDE = 7
# The dynamic graph was traced with S, K and width >= 2; steps run there are padded to at least that.
MIN_DYNAMIC_SIZE = 2
# Room the persistent buffers need beyond the engine's limits: sequence rows to pad S and K to 2
# in the dynamic graph, and block-table columns for a width-2 bucket example whose row stride
# differs from its width (equal, the shape env would tie the stride to the width symbol and every
# narrower step would fail Inductor's stride check).
MIN_BUFFER_SEQS = 2
MIN_BUFFER_BLOCKS = 3


def dynamic_dim1(source: str) -> bool:
    """Inputs whose dim 1 is symbolic in every bucket graph: block tables and KV caches."""
    return source == _BLOCK_TABLES or _KV_CACHE.fullmatch(source) is not None


def check_buffer_room(buffers: StepInputs) -> None:
    seqs, blocks = buffers.block_tables.shape
    if seqs < MIN_BUFFER_SEQS or blocks < MIN_BUFFER_BLOCKS:
        raise ValueError(
            f"a compiled step needs buffers with at least {MIN_BUFFER_SEQS} sequence rows and "
            f"{MIN_BUFFER_BLOCKS} block-table columns, got block_tables {seqs}x{blocks}"
        )


def _trace_inputs(device: torch.device) -> StepInputs:
    lens = torch.tensor(_TRACE_QUERY_LENS)
    num_tokens, num_seqs = int(lens.sum()), len(_TRACE_QUERY_LENS)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = lens.cumsum(0)
    positions = torch.cat([torch.arange(n) for n in _TRACE_QUERY_LENS])
    tables = torch.zeros(num_seqs, _TRACE_TABLE_STRIDE, dtype=torch.int32)
    # Full prefills: seq_len == query length (<= 5), which fits in _TRACE_WIDTH blocks of any size.
    inputs = StepInputs(
        input_ids=torch.zeros(1, num_tokens, dtype=torch.int64),
        positions=positions[None],
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        block_tables=tables[:, :_TRACE_WIDTH],
        seq_lens=lens.to(torch.int32),
        query_start_loc=query_start_loc,
        logits_indices=(query_start_loc[1:][list(_TRACE_SAMPLED)] - 1).long(),
    )
    return StepInputs(*(t.to(device) for t in inputs))


class TracedStep:
    """The one general lowered graph of a model's step, with its calling convention.

    `graph`: the lowered GraphModule; `example_inputs`: its kept (not frozen) inputs;
    `convention`: how to call it; `pass_log`: its capture-time pass report (one entry);
    `pass_manager`: the manager that ran them, which also holds the per-bucket passes.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        fuse_linears: bool = True,
        attention_backend: AttentionBackend | None = None,
        tensor_parallel: TensorParallelLayout | None = None,
        quantization: WeightQuantization | None = None,
    ) -> None:
        recorded: list[tuple[fx.GraphModule, list[Any], CallingConvention]] = []

        def record(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            recorded.append((gm, list(example_inputs), CallingConvention.from_graph(gm)))
            return gm.forward

        # `record` runs after the passes, on the frozen graph and its kept example inputs.
        captured = capture_model(
            model,
            kv_caches,
            graph_compiler=record,
            fuse_linears=fuse_linears,
            attention_backend=attention_backend,
            tensor_parallel=tensor_parallel,
            quantization=quantization,
        )
        # `patch` is added to torch's config modules at import time (install_config_module), so
        # their type stubs do not show it.
        with fx_config.patch(use_duck_shape=False), torch.inference_mode():  # type: ignore[attr-defined]
            captured(_trace_inputs(kv_caches[0].device))
        if len(recorded) != 1:
            raise RuntimeError(f"tracing the step produced {len(recorded)} graphs, expected exactly 1")
        self.graph, self.example_inputs, self.convention = recorded[0]
        self.pass_log: list[PassReport] = captured.pass_log
        self.pass_manager: PassManager = captured.pass_manager
        if _WIDTH not in self.convention.sources:
            raise RuntimeError("the traced graph has no block-table width input; it was specialised")
