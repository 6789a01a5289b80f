"""A bucket's graph, rewritten by its per-bucket passes and compiled by Inductor.

Each bucket graph is a variant of the traced graph (graphs/traced_step.py), sharing its
weights: always a fresh GraphModule, even when no pass applies, because the compile takes
ownership of its graph (graphs/standalone_compile.py). The pass manager's per-bucket passes
(graphs/pass_pipeline.py: GEMV lowering or oneDNN-packed linears where graphs/gemv_policy.py
measured them to win, the inline attention maths for decode buckets on CPU) rewrite it, and
their report travels with the compiled graph into the compile cache.

Static in T, S and K; the block-table width and the caches' block count stay symbolic
(graphs/buckets.py says why). The dynamic graph (bucket None) keeps every size symbolic, for
steps above the largest bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from compiled_engine.graphs.buckets import bucket_shape
from compiled_engine.graphs.constant_recipes import Recipe, lifted_constant_recipes
from compiled_engine.graphs.gemv_policy import share_graph_module
from compiled_engine.graphs.pass_manager import BucketTarget, PassReport
from compiled_engine.graphs.standalone_compile import compile_donated, compile_with_fake_mode
from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.graphs.traced_step import MIN_DYNAMIC_SIZE, TracedStep, dynamic_dim1


class BucketVariant(NamedTuple):
    """The per-bucket rewrites a bucket's graph got before Inductor (read off its pass report)."""

    gemv: bool = False  # linears lowered to multiply-sums (graphs/gemv_policy.py)
    inline_attention: bool = False  # attention as fused maths (graphs/passes/inline_attention.py)
    packed_linears: bool = False  # linears on oneDNN-packed weights (graphs/passes/onednn_linear.py)
    gemv_kernel: bool = False  # linears on the C++ GEMV (graphs/passes/cpu_gemv.py)
    # quantized linears on the C++ GEMV's int8/int4 variants (graphs/passes/cpu_gemv_quantized.py)
    quantized_gemv_kernel: bool = False
    widened_linears: bool = False  # bf16 / fp16 linears as fp32 GEMMs (graphs/passes/widened_linear.py)

    @classmethod
    def from_report(cls, passes: PassReport) -> BucketVariant:
        return cls(
            gemv=passes.ran("gemv_lowering"),
            inline_attention=passes.ran("inline_attention"),
            packed_linears=passes.ran("pack_linear_weights"),
            gemv_kernel=passes.ran("cpu_gemv_linears"),
            quantized_gemv_kernel=passes.ran("cpu_gemv_quantized"),
            widened_linears=passes.ran("widen_linears"),
        )


@dataclass(frozen=True)
class BucketBuild:
    """How one bucket's compiled graph was obtained at start-up or first use."""

    bucket: int | None  # None: the dynamic graph
    source: str  # "compiled" (traced graph through Inductor) or "loaded" (from the compile cache)
    seconds: float
    saved: bool  # written to the compile cache
    passes: PassReport = PassReport(())  # the per-bucket passes its graph got

    @property
    def variant(self) -> BucketVariant:
        return BucketVariant.from_report(self.passes)


@dataclass(frozen=True)
class CompiledBucket:
    artifact: Any  # Inductor's CompiledArtifact, called with the step's arguments
    recipes: list[Recipe] | str  # how to rebuild its lifted weights, or why it cannot be saved
    passes: PassReport


def bucket_graph(traced: TracedStep, target: BucketTarget) -> tuple[fx.GraphModule, PassReport]:
    """The graph to compile for `target`: a variant of the traced graph (sharing its weights)
    with the per-bucket passes that apply to it, and their report."""
    variant = share_graph_module(traced.graph)
    return variant, traced.pass_manager.run_bucket(variant, target)


def compile_bucket(
    traced: TracedStep, target: BucketTarget, example_inputs: Callable[[int, FakeTensorMode], list[Any]]
) -> CompiledBucket:
    """Inductor-compile `target`'s graph. `example_inputs(bucket, fake_mode)`: the fake
    arguments of a static bucket (`bucket_example_inputs`); the dynamic graph uses the trace's."""
    graph, passes = bucket_graph(traced, target)
    try:  # read before the compile, which owns (and may change) the graph
        recipes: list[Recipe] | str = lifted_constant_recipes(graph)
    except ValueError as exc:
        recipes = str(exc)
    # Float attributes (the attention scale) stay Python floats, as in the capture.
    with torch._dynamo.config.patch(specialize_float=True):
        if target.bucket is None:
            compiled = compile_donated(graph, traced.example_inputs, dynamic_shapes="from_graph")
        else:
            # No duck shaping: a bucket's width example (2) must not be tied to an equal-sized
            # block count, or to anything else that happens to match.
            fake_mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))
            compiled = compile_with_fake_mode(graph, example_inputs(target.bucket, fake_mode), fake_mode)
    return CompiledBucket(compiled, recipes, passes)


def bucket_example_inputs(
    bucket: int,
    fake_mode: FakeTensorMode,
    buffers: StepInputs,
    max_num_seqs: int,
    sources: Sequence[str],
    step_args: Callable[[StepInputs], list[Any]],
) -> list[Any]:
    """Fake arguments at the bucket's static shape, with the block-table width symbolic.

    `sources`: the calling convention's input sources; `step_args(views)`: the real arguments
    for views of the persistent `buffers`.
    """
    shape = bucket_shape(bucket, max_num_seqs)
    b = buffers
    # Width 2: 1 would be specialised away by the shape env; 2 < the row stride (>= 3).
    width = MIN_DYNAMIC_SIZE
    views = StepInputs(
        input_ids=b.input_ids[:, : shape.num_tokens],
        positions=b.positions[:, : shape.num_tokens],
        slot_mapping=b.slot_mapping[: shape.num_tokens],
        block_tables=b.block_tables[: shape.num_seqs, :width],
        seq_lens=b.seq_lens[: shape.num_seqs],
        query_start_loc=b.query_start_loc[: shape.num_seqs + 1],
        logits_indices=b.logits_indices[: shape.num_seqs],
    )
    real = step_args(views)
    fakes: list[Any] = []
    symbols: dict[str, Any] = {}  # "<tensor source>.size()[1]" -> that fake's symbol
    for source, value in zip(sources, real, strict=True):
        if isinstance(value, torch.Tensor) and dynamic_dim1(source):
            # Dim 1 stays symbolic: the block-table width, the KV caches' block count.
            dynamic = [DimDynamic.STATIC] * value.dim()
            dynamic[1] = DimDynamic.DYNAMIC
            fake = fake_mode.from_tensor(
                value, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dynamic)
            )
            symbols[f"{source}.size()[1]"] = fake.size(1)
            fakes.append(fake)
        elif isinstance(value, torch.Tensor):
            fakes.append(fake_mode.from_tensor(value, static_shapes=True))
        else:
            fakes.append(value)
    return [symbols.get(s, f) for s, f in zip(sources, fakes, strict=True)]
