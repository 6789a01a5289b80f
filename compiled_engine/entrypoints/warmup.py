"""`compiled-engine warmup`: build every bucket's compiled graph into the compile cache now.

The table it prints has a row per graph, with the per-bucket passes its graph got (read from
the artifact's header when it was loaded from the cache).

A later `LLM(...)` (or `compiled-engine generate`) with the same options then starts warm: it
loads the graphs instead of tracing and compiling (graphs/compile_cache.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compiled_engine.graphs.bucket_compiler import BucketBuild, BucketVariant
from compiled_engine.graphs.pass_manager import PassReport
from compiled_engine.graphs.step_graph import StepGraph
from compiled_engine.records.graph_status import graph_label


@dataclass(frozen=True)
class WarmupRow:
    bucket: int | None
    build: BucketBuild
    # How the graph attends: "inline" (Inductor-fused maths) or the attention backend's op, with
    # the KV cache's codes when quantized ("cpu int8-kv").
    attention: str
    # How the linears hold their weights: the weight quantization's label ("int8", "int4-g32") or
    # the model dtype ("bfloat16").
    weights: str = "-"


def warm_up_buckets(
    step: StepGraph, show_progress: bool = True, kv_cache_dtype: str = "auto", weights: str = "-"
) -> list[WarmupRow]:
    """Build (load or compile) every graph the step can run, with a progress bar. `kv_cache_dtype`
    (the engine's, resolved) labels the attention column when the cache is quantized; `weights`:
    how the linears hold their weights, for the table (the engine config's quantization or dtype)."""
    buckets = step.all_buckets()
    step.compile_buckets(buckets, show_progress=show_progress)
    backend = step.attention_backend.name if step.attention_backend is not None else "torch"
    suffix = "" if kv_cache_dtype == "auto" else f" {kv_cache_dtype}-kv"
    return [
        WarmupRow(
            bucket,
            step.builds[bucket],
            ("inline" if step.builds[bucket].variant.inline_attention else backend) + suffix,
            weights,
        )
        for bucket in buckets
    ]


def linears_label(variant: BucketVariant) -> str:
    """How a graph runs its linears: GEMV-lowered, the C++ GEMV, oneDNN-packed, widened to fp32
    GEMMs or torch's GEMM."""
    if variant.gemv_kernel and variant.quantized_gemv_kernel:
        return "cpu_gemv+quantized"
    if variant.quantized_gemv_kernel:
        return "cpu_gemv_quantized"
    if variant.gemv_kernel:
        return "cpu_gemv"
    if variant.widened_linears:
        return "widened"
    return "gemv" if variant.gemv else "onednn" if variant.packed_linears else "torch"


def passes_label(passes: PassReport) -> str:
    """The per-bucket passes a graph got, each with the nodes it rewrote: `name:nodes,...` or `-`."""
    return ",".join(f"{r.pass_name}:{r.nodes_rewritten}" for r in passes.results) or "-"


def format_table(rows: Sequence[WarmupRow]) -> str:
    """One line per graph: bucket, cache hit or miss, its rewrites (summed up, then each
    per-bucket pass's result), seconds to compile or load, saved, and how the linears hold their
    weights (the quantization, or the model dtype)."""
    header = ("bucket", "cache", "linears", "attention", "passes", "compile s", "load s", "saved", "weights")
    lines = [header]
    for row in rows:
        build = row.build
        hit = build.source == "loaded"
        lines.append(
            (
                graph_label(row.bucket),
                "hit" if hit else "miss",
                linears_label(build.variant),
                row.attention,
                passes_label(build.passes),
                "-" if hit else f"{build.seconds:.2f}",
                f"{build.seconds:.2f}" if hit else "-",
                "yes" if build.saved else "no",
                row.weights,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)
