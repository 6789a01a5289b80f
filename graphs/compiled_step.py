"""Inductor-compiled step graphs, one per token-count bucket, called without Dynamo.

`CompiledStep(model, kv_caches, buffers, buckets, fuse_linears=True)`:
1. traces the step once through Dynamo (graphs/capture.py, passes included: with
   `fuse_linears`, weights frozen and q/k/v and gate/up fused into one GEMM each) on a synthetic
   step whose T, S, K and block-table width are all different and >= 2, with duck shaping
   off, so the one general graph keeps every size as its own symbol (duck shaping would tie
   equal example sizes together, and 0/1 sizes would be specialised). The synthetic step's
   slot_mapping is all -1: tracing writes nothing into the KV cache;
2. freezes the graph's calling convention (graphs/calling_convention.py), read after the
   passes: frozen weights are no longer inputs, the compiled graph holds them;
3. compiles it with Inductor (`torch._inductor.standalone_compile`) per bucket, static in T,
   S and K and dynamic in the block-table width (graphs/buckets.py says why), lazily on first
   use or up front with `compile_buckets()`; plus once with all sizes dynamic for steps above
   the largest bucket.

`__call__(inputs)` pads the step in the persistent buffers (graphs/buckets.py), builds the
arguments and calls the compiled artifact directly: no guard evaluation per step.

Inductor caches its artifacts under TORCHINDUCTOR_CACHE_DIR (its default when unset), which
makes a second engine start mostly cache hits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from compiled_engine.graphs.buckets import bucket_for, bucket_shape, check_buckets, pad_step
from compiled_engine.graphs.calling_convention import CallingConvention
from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.step_inputs import StepInputs

_BLOCK_TABLES = "L['inputs'].block_tables"
_WIDTH = "L['inputs'].block_tables.size()[1]"
# The synthetic trace step: every size distinct and >= 2 (see the module docstring).
_TRACE_QUERY_LENS = (4, 5, 4)  # T = 13, S = 3
_TRACE_SAMPLED = (0, 2)  # K = 2
_TRACE_WIDTH = 5
_TRACE_TABLE_STRIDE = 7
# The dynamic graph was traced with S, K and width >= 2; steps run there are padded to at least that.
_MIN_DYNAMIC_SIZE = 2
# Room the persistent buffers need beyond the engine's limits: sequence rows to pad S and K to 2
# in the dynamic graph, and block-table columns for a width-2 bucket example whose row stride
# differs from its width (equal, the shape env would tie the stride to the width symbol and every
# narrower step would fail Inductor's stride check).
MIN_BUFFER_SEQS = 2
MIN_BUFFER_BLOCKS = 3


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
    """The one general lowered graph of a model's step, with its calling convention."""

    def __init__(
        self, model: torch.nn.Module, kv_caches: list[torch.Tensor], fuse_linears: bool = True
    ) -> None:
        recorded: list[tuple[fx.GraphModule, list[Any], CallingConvention]] = []

        def record(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            recorded.append((gm, list(example_inputs), CallingConvention.from_graph(gm)))
            return gm.forward

        # `record` runs after the passes, on the frozen graph and its kept example inputs.
        captured = capture_model(model, kv_caches, graph_compiler=record, fuse_linears=fuse_linears)
        with fx_config.patch(use_duck_shape=False), torch.inference_mode():
            captured(_trace_inputs(kv_caches[0].device))
        if len(recorded) != 1:
            raise RuntimeError(f"tracing the step produced {len(recorded)} graphs, expected exactly 1")
        self.graph, self.example_inputs, self.convention = recorded[0]
        self.pass_log = captured.pass_log
        if _WIDTH not in self.convention.sources:
            raise RuntimeError("the traced graph has no block-table width input; it was specialised")


class CompiledStep:
    """`__call__(StepInputs) -> logits [K, vocab]` through Inductor-compiled bucket graphs.

    `buffers`: the runner's whole persistent tensors (a StepInputs of full-size buffers, with
    the room `check_buffer_room` asks for); each step's inputs must be views at their front
    (worker/input_buffers.py), so padding is written in place behind them.
    `fuse_linears`: fuse sibling linears into one GEMM each (graphs/passes/fuse_linears.py).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        buffers: StepInputs,
        buckets: Sequence[int],
        fuse_linears: bool = True,
    ) -> None:
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.max_num_tokens = buffers.slot_mapping.shape[0]
        self.max_num_seqs = buffers.seq_lens.shape[0]
        self.buckets = check_buckets(buckets, self.max_num_tokens)
        check_buffer_room(buffers)
        self.traced = TracedStep(model, kv_caches, fuse_linears)
        self._build_args = self.traced.convention.bind(model)
        self._artifacts: dict[int | None, Callable[..., Any]] = {}
        # Seconds each compile took, keyed by bucket (None: the dynamic graph).
        self.compile_seconds: dict[int | None, float] = {}

    @property
    def compiled_buckets(self) -> tuple[int | None, ...]:
        return tuple(self._artifacts)

    def compile_buckets(self, buckets: Sequence[int | None] | None = None) -> None:
        """Compile these buckets now (default: all, and the dynamic graph if it can be reached)."""
        if buckets is None:
            buckets = list(self.buckets)
            if self.buckets[-1] < self.max_num_tokens:
                buckets.append(None)
        for bucket in buckets:
            if bucket is not None and bucket not in self.buckets:
                raise ValueError(f"{bucket} is not one of the buckets {self.buckets}")
            self._artifact(bucket)

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        num_tokens = inputs.slot_mapping.shape[0]
        num_logits = inputs.logits_indices.shape[0]
        bucket = bucket_for(num_tokens, self.buckets)
        width = inputs.block_tables.shape[1]
        if bucket is not None:
            shape = bucket_shape(bucket, self.max_num_seqs)
            padded = pad_step(self.buffers, inputs, shape.num_tokens, shape.num_seqs, shape.num_seqs, width)
        else:
            padded = pad_step(
                self.buffers,
                inputs,
                num_tokens,
                max(inputs.seq_lens.shape[0], _MIN_DYNAMIC_SIZE),
                max(num_logits, _MIN_DYNAMIC_SIZE),
                max(width, _MIN_DYNAMIC_SIZE),
            )
        artifact = self._artifact(bucket)
        with torch.no_grad():
            logits = artifact(*self._build_args(padded, self.kv_caches))[0]
        return logits[:num_logits]

    def _artifact(self, bucket: int | None) -> Callable[..., Any]:
        artifact = self._artifacts.get(bucket)
        if artifact is None:
            start = time.perf_counter()
            artifact = self._compile(bucket)
            self.compile_seconds[bucket] = time.perf_counter() - start
            self._artifacts[bucket] = artifact
        return artifact

    def _compile(self, bucket: int | None) -> Callable[..., Any]:
        traced = self.traced
        # Float attributes (the attention scale) stay Python floats, as in the capture.
        with torch._dynamo.config.patch(specialize_float=True):
            if bucket is None:
                return torch._inductor.standalone_compile(
                    traced.graph, traced.example_inputs, dynamic_shapes="from_graph"
                )
            fake_mode = FakeTensorMode(shape_env=ShapeEnv())
            example = self._bucket_example_inputs(bucket, fake_mode)
            return torch._inductor.standalone_compile(
                traced.graph, example, dynamic_shapes="from_example_inputs", fake_mode=fake_mode
            )

    def _bucket_example_inputs(self, bucket: int, fake_mode: FakeTensorMode) -> list[Any]:
        """Fake arguments at the bucket's static shape, with the block-table width symbolic."""
        shape = bucket_shape(bucket, self.max_num_seqs)
        b = self.buffers
        # Width 2: 1 would be specialised away by the shape env; 2 < the row stride (>= 3).
        width = _MIN_DYNAMIC_SIZE
        views = StepInputs(
            input_ids=b.input_ids[:, : shape.num_tokens],
            positions=b.positions[:, : shape.num_tokens],
            slot_mapping=b.slot_mapping[: shape.num_tokens],
            block_tables=b.block_tables[: shape.num_seqs, :width],
            seq_lens=b.seq_lens[: shape.num_seqs],
            query_start_loc=b.query_start_loc[: shape.num_seqs + 1],
            logits_indices=b.logits_indices[: shape.num_seqs],
        )
        real = self._build_args(views, self.kv_caches)
        sources = self.traced.convention.sources
        fakes: list[Any] = []
        width_symbol: Any = width
        dynamic_width = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC])
        for source, value in zip(sources, real, strict=True):
            if source == _BLOCK_TABLES:
                fake = fake_mode.from_tensor(value, symbolic_context=dynamic_width)
                width_symbol = fake.size(1)
                fakes.append(fake)
            elif isinstance(value, torch.Tensor):
                fakes.append(fake_mode.from_tensor(value, static_shapes=True))
            else:
                fakes.append(value)
        return [width_symbol if s == _WIDTH else f for s, f in zip(sources, fakes, strict=True)]
