"""The engine's pass pipeline: which passes run, where, in what order.

At capture (every graph Dynamo hands the backend, graphs/capture.py):

    [freeze_parameters] → {tensor_parallel} → lower_sdpa → [fuse_linears] → <quantize_linears>
      → noop_elimination → dce → check_lowering → (select_attention_backend)

    […]: with fused weights (the compiled path); {…}: tensor_parallel_size > 1;
    <…>: with weight quantization (freeze_parameters then runs on the eager path too);
    (…): an attention backend other than the torch op.

Per bucket (each bucket's variant of the traced graph, graphs/bucket_compiler.py):

    gemv_lowering        where the GEMV policy measured the lowering to win at this bucket
    cpu_gemv_linears     else, where it measured the C++ GEMV (kernels/cpu_gemv.py) to win
    cpu_gemv_quantized   with weight quantization, where it measured the C++ GEMV's int8/int4
                         variants faster than torch's kernels at this bucket's rows
    pack_linear_weights  else, where it measured oneDNN over packed weights to win
    widen_linears        else, where oneDNN cannot run the dtype (bf16 / fp16 without native
                         half-precision GEMMs) and it measured fp32 GEMMs over widened
                         weights (kernels/widened_linear.py) to win
    inline_attention     on CPU with the torch op, for buckets that can be a decode batch
                         (<= max_num_seqs): the fused maths replaces ~40 eager calls per layer;
                         prefill-sized buckets and the dynamic graph keep the op, whose chunked
                         matmuls suit long queries; other devices keep it (their kernels come from it)

With COMPILED_ENGINE_DUMP_GRAPHS=DIR set when the manager is made, every graph it processes
is written to DIR before and after each pass (graphs/graph_dump.py).
"""

from __future__ import annotations

import torch

from compiled_engine.distributed.layout import TensorParallelLayout
from compiled_engine.graphs.graph_dump import DumpingPassManager, dump_dir_from_env
from compiled_engine.graphs.pass_manager import (
    AtCapture,
    BucketTarget,
    PassManager,
    PipelinePass,
    at_capture,
    per_bucket,
)
from compiled_engine.graphs.passes.check_lowering import CheckLowering
from compiled_engine.graphs.passes.cpu_gemv import CpuGemvLinears
from compiled_engine.graphs.passes.cpu_gemv_quantized import CpuGemmQuantized, CpuGemvQuantized
from compiled_engine.graphs.passes.dce import DeadCodeElimination
from compiled_engine.graphs.passes.freeze_parameters import FreezeParameters
from compiled_engine.graphs.passes.fuse_linears import FusedWeightCache, FuseLinears
from compiled_engine.graphs.passes.gemv_lowering import GemvLowering
from compiled_engine.graphs.passes.inline_attention import InlineAttention
from compiled_engine.graphs.passes.lower_sdpa import LowerSdpa
from compiled_engine.graphs.passes.noop_elimination import NoopElimination
from compiled_engine.graphs.passes.onednn_linear import PackLinearWeights
from compiled_engine.graphs.passes.quantize_linears import QuantizedWeightCache, QuantizeLinears
from compiled_engine.graphs.passes.select_attention_backend import SelectAttentionBackend
from compiled_engine.graphs.passes.tensor_parallel import ShardForTensorParallel
from compiled_engine.graphs.passes.widened_linear import WidenLinears
from compiled_engine.kernels.backends import AttentionBackend
from compiled_engine.records.weight_quantization import WeightQuantization


def lowers_linears(target: BucketTarget) -> bool:
    """The GEMV policy measured the multiply-sum lowering to win at this bucket's rows."""
    return target.bucket is not None and target.linears.lowers(target.bucket)


def runs_gemv_kernel(target: BucketTarget) -> bool:
    """Not lowered, and the policy measured the C++ GEMV to win at this bucket's rows."""
    return (
        target.bucket is not None and not lowers_linears(target) and target.linears.runs_kernel(target.bucket)
    )


def packs_linears(target: BucketTarget) -> bool:
    """Neither lowered nor on the C++ GEMV, and the policy measured oneDNN over packed weights to win here."""
    return not lowers_linears(target) and not runs_gemv_kernel(target) and target.linears.packs(target.bucket)


def widens_linears(target: BucketTarget) -> bool:
    """Neither lowered nor on the C++ GEMV, and the policy measured the widened fp32 GEMM to win here."""
    return (
        not lowers_linears(target) and not runs_gemv_kernel(target) and target.linears.widens(target.bucket)
    )


def runs_quantized_gemv_kernel(target: BucketTarget) -> bool:
    """The policy measured the C++ GEMV's int8/int4 variants faster than torch's kernels at this bucket."""
    return target.bucket is not None and target.linears.runs_quantized_kernel(target.bucket)


def runs_quantized_tiles(target: BucketTarget) -> bool:
    """The policy measured the kernel's int8/int4 tile path fastest at this bucket (many rows),
    or, for the dynamic graph (steps past every bucket), at any bucket."""
    return target.linears.runs_quantized_tiles(target.bucket)


def inlines_attention(target: BucketTarget) -> bool:
    """On CPU with the torch op, decode-sized buckets get the attention as fusable maths."""
    return target.attention_backend == "torch" and target.device_kind == "cpu" and target.decode_sized


FREEZE_PARAMETERS = PipelinePass(
    FreezeParameters.name,
    FreezeParameters.version,
    # One instance per graph: it needs that graph's example inputs to tell weights apart.
    AtCapture(lambda graph: FreezeParameters(graph.example_inputs)),
)


def _gemv_lowering(target: BucketTarget) -> GemvLowering:
    assert target.bucket is not None  # lowers_linears never picks the dynamic graph
    return GemvLowering(max_rows=target.bucket, rows_hint=target.bucket)


BUCKET_PASSES = (
    per_bucket(GemvLowering, lowers_linears, _gemv_lowering),
    per_bucket(CpuGemvLinears, runs_gemv_kernel),
    per_bucket(PackLinearWeights, packs_linears),
    per_bucket(WidenLinears, widens_linears),
    per_bucket(CpuGemvQuantized, runs_quantized_gemv_kernel),
    per_bucket(CpuGemmQuantized, runs_quantized_tiles),
    per_bucket(InlineAttention, inlines_attention),
)


def default_pass_manager(
    model_class_name: str,
    num_attention_layers: int | None,
    fused_weights: FusedWeightCache | None = None,
    attention_backend: AttentionBackend | None = None,
    tensor_parallel: TensorParallelLayout | None = None,
    quantization: WeightQuantization | None = None,
    lm_head: torch.Tensor | None = None,
    model: torch.nn.Module | None = None,
) -> PassManager:
    """The pipeline above for one model.

    With `fused_weights` (the model's shared cache of concatenated weights), the weights are
    frozen into constants first and sibling linears fused after the SDPA lowering. No-op
    elimination runs after the rewriting passes (so it also sees the nodes they add) and before
    DCE, which removes what it leaves unused (the other operand of a dropped `type_as`).
    `attention_backend` other than "torch": a last pass points the attention calls at that
    backend's op. `tensor_parallel` (this rank's layout): a pass inserts the collectives that
    make the sharded weights' partial outputs whole. `quantization`: the linears but the LM head
    (`lm_head`, the output embedding's weight) become weight-only quantized ops, each weight
    quantized once for all the model's graphs (a pre-quantized checkpoint's integers are read off
    `model`); the weights are then frozen even without fusion (only constants are quantized).
    """
    passes: list[PipelinePass] = []
    if fused_weights is not None or quantization is not None:
        passes.append(FREEZE_PARAMETERS)
    if tensor_parallel is not None:
        passes.append(at_capture(ShardForTensorParallel(tensor_parallel)))
    passes.append(at_capture(LowerSdpa()))
    if fused_weights is not None:
        passes.append(at_capture(FuseLinears(fused_weights)))
    if quantization is not None:
        passes.append(at_capture(QuantizeLinears(QuantizedWeightCache(quantization, model), lm_head)))
    passes += [
        at_capture(NoopElimination()),
        at_capture(DeadCodeElimination()),
        at_capture(CheckLowering(model_class_name, num_attention_layers)),
    ]
    if attention_backend is not None and attention_backend.name != "torch":
        passes.append(at_capture(SelectAttentionBackend(attention_backend)))
    passes += BUCKET_PASSES
    return DumpingPassManager(passes, dump_dir_from_env())
