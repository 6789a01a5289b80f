"""`compiled-engine warmup`: build every bucket's compiled graph into the compile cache now.

A later `LLM(...)` (or `compiled-engine generate`) with the same options then starts warm: it
loads the graphs instead of tracing and compiling (graphs/compile_cache.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from compiled_engine.graphs.compiled_step import BucketBuild, BucketVariant, CompiledStep


@dataclass(frozen=True)
class WarmupRow:
    bucket: int | None
    build: BucketBuild
    # How the graph attends: "inline" (Inductor-fused maths) or the attention backend's op.
    attention: str


def warm_up_buckets(step: CompiledStep, show_progress: bool = True) -> list[WarmupRow]:
    """Build (load or compile) every graph the step can run, with a progress bar."""
    buckets = step.all_buckets()
    with tqdm(total=len(buckets), desc="Building graphs", unit="graph", disable=not show_progress) as bar:
        for bucket in buckets:
            bar.set_postfix_str(_bucket_label(bucket))
            step.compile_buckets([bucket])
            bar.update(1)
    backend = step.attention_backend.name if step.attention_backend is not None else "torch"
    return [
        WarmupRow(
            bucket, step.builds[bucket], "inline" if step.builds[bucket].variant.inline_attention else backend
        )
        for bucket in buckets
    ]


def _bucket_label(bucket: int | None) -> str:
    return "dynamic" if bucket is None else str(bucket)


def linears_label(variant: BucketVariant) -> str:
    """How a graph runs its linears: GEMV-lowered, oneDNN over packed weights, or torch's GEMM."""
    return "gemv" if variant.gemv else "onednn" if variant.packed_linears else "torch"


def format_table(rows: Sequence[WarmupRow]) -> str:
    """One line per graph: bucket, cache hit or miss, its rewrites, seconds to compile or load, saved."""
    header = ("bucket", "cache", "linears", "attention", "compile s", "load s", "saved")
    lines = [header]
    for row in rows:
        build = row.build
        hit = build.source == "loaded"
        lines.append(
            (
                _bucket_label(row.bucket),
                "hit" if hit else "miss",
                linears_label(build.variant),
                row.attention,
                "-" if hit else f"{build.seconds:.2f}",
                f"{build.seconds:.2f}" if hit else "-",
                "yes" if build.saved else "no",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)
