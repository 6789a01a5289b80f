"""bench/gpu_check.py's attention sections: each backend against the reference, and decode timings.

Parity: every attention backend that can run on the device (kernels/backends.py) is called on
random paged batches — prefill chunks, decodes and padding mixed, GQA, a sliding window,
soft-capping, shuffled block tables with unused blocks between — in float32, float16 and (on
CUDA) bfloat16, and its output and KV cache are compared with kernels/reference.py's.

Decode timings: one decode step (one query per sequence, every sequence at the same context)
per backend for batch x context, with the bandwidth it achieves (the K and V bytes it must read
once, over its time) against the device's measured copy bandwidth.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import compiled_engine.kernels  # noqa: F401  (registers the ops)
from compiled_engine.kernels.backends import (
    ATTENTION_BACKENDS,
    AttentionBackendUnavailableError,
    resolve_attention_backend,
)
from compiled_engine.kernels.reference import paged_attention_reference

# |out - ref| <= ATOL + RTOL * |ref|, per dtype: fp32 maths everywhere, inputs rounded to the dtype.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}

# Llama-3-8B's attention shape for the GPU timings; a small one for CPU (and --quick).
GPU_SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
SMALL_SHAPE = dict(num_q_heads=8, num_kv_heads=4, head_dim=64, block_size=16)
GPU_BATCHES = (1, 8, 32, 64, 128, 256)
GPU_CONTEXTS = (512, 2048, 8192)
# The reference gathers every context: past this many cached tokens per call it is only slow.
REFERENCE_TOKEN_LIMIT = 64 * 2048


@dataclass
class PagedBatch:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def args(self, kv_cache: torch.Tensor) -> tuple:
        return (
            self.query,
            self.key,
            self.value,
            kv_cache,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
        )


def random_batch(
    query_lens: list[int],
    context_lens: list[int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
    holes: bool = True,
) -> PagedBatch:
    """Sequence s holds context_lens[s] cached tokens after this step, the last query_lens[s] new.

    With `holes`, as many unused blocks as used ones sit between them (twice the cache memory:
    the timings turn it off). Random values are drawn on the device (GB-sized caches on GPU)."""
    gen = torch.Generator().manual_seed(seed)
    device_gen = torch.Generator(device=device).manual_seed(seed)
    num_seqs = len(query_lens)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    width = max(max(blocks_per_seq), 1)
    spread = 2 if holes else 1
    num_blocks = spread * sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks - 1, generator=gen)  # the last block is the scratch block
    table = torch.full((num_seqs, width), -1, dtype=torch.int32)
    next_block = 0
    for s, n in enumerate(blocks_per_seq):
        table[s, :n] = order[next_block : next_block + n]
        next_block += spread * n
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(cache_shape, generator=device_gen, device=device, dtype=torch.float32).to(dtype)
    num_tokens = sum(query_lens)
    slots = []
    for s, (q, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        for p in range(c - q, c):
            slots.append(int(table[s, p // block_size]) * block_size + p % block_size)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)

    def rand(*shape):
        return torch.randn(*shape, generator=device_gen, device=device).to(dtype)

    return PagedBatch(
        query=rand(num_tokens, num_q_heads, head_dim),
        key=rand(num_tokens, num_kv_heads, head_dim),
        value=rand(num_tokens, num_kv_heads, head_dim),
        kv_cache=cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=qsl.to(device),
    )


PARITY_CASES = {
    # name: (query lens, context lens, sliding window, softcap)
    "mixed prefill/extend/decode": ([5, 1, 3, 1], [5, 40, 19, 1], -1, 0.0),
    "decode, long contexts": ([1, 1, 1], [700, 1100, 64], -1, 0.0),
    "sliding window": ([4, 1], [50, 90], 16, 0.0),
    "soft-capping": ([3, 1], [30, 33], -1, 30.0),
}
# Under triton's interpreter (CPU) long contexts take minutes: --quick keeps the short cases.
QUICK_PARITY_CASES = {k: v for k, v in PARITY_CASES.items() if k != "decode, long contexts"}


def available_backends(device: torch.device) -> dict[str, str]:
    """Every explicit backend name -> its version if it runs on `device`, else why not."""
    found = {}
    for name in ATTENTION_BACKENDS:
        if name == "auto":
            continue
        try:
            found[name] = resolve_attention_backend(name, device).version
        except (AttentionBackendUnavailableError, NotImplementedError) as exc:
            found[name] = f"unavailable: {exc}"
    return found


def parity_lines(
    device: torch.device, shape: dict, cases: dict = PARITY_CASES
) -> tuple[list[str], list[str]]:
    """Markdown rows for every runnable backend x dtype x case, and the failures."""
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])
    lines = ["| backend | dtype | case | max abs err | cache equal | ok |", "|---|---|---|---:|---|---|"]
    failures = []
    for name, version in available_backends(device).items():
        if version.startswith("unavailable"):
            lines.append(f"| {name} | — | — | — | — | {version} |")
            continue
        op = resolve_attention_backend(name, device).op
        for dtype in dtypes:
            atol, rtol = TOLERANCE[dtype]
            for case, (q_lens, c_lens, window, softcap) in cases.items():
                batch = random_batch(q_lens, c_lens, dtype, device, **shape, seed=len(case))
                scale = shape["head_dim"] ** -0.5
                ref_cache, got_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
                ref = paged_attention_reference(*batch.args(ref_cache), scale, window, softcap)
                got = op(*batch.args(got_cache), scale, window, softcap)
                err = (got.float() - ref.float()).abs()
                ok = bool((err <= atol + rtol * ref.float().abs()).all())
                same_cache = torch.equal(got_cache, ref_cache)
                if not (ok and same_cache):
                    failures.append(f"{name} {dtype} {case}")
                lines.append(
                    f"| {name} | {str(dtype).removeprefix('torch.')} | {case} | {err.max().item():.2e} | "
                    f"{'yes' if same_cache else 'NO'} | {'ok' if ok and same_cache else 'FAIL'} |"
                )
    return lines, failures


def copy_bandwidth_gb_s(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a large device copy (the roofline for a bandwidth-bound op)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, calls=10)
    return 2 * num_bytes / seconds / 1e9


def median_seconds(call: Callable[[], object], device: torch.device, calls: int = 20) -> float:
    times = []
    for _ in range(calls + 3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
    return statistics.median(times[3:])  # the first calls compile and warm caches


def decode_timing_lines(
    device: torch.device,
    shape: dict,
    batches: tuple[int, ...],
    contexts: tuple[int, ...],
    dtype: torch.dtype,
    bandwidth_gb_s: float,
    calls: int = 20,
) -> list[str]:
    lines = [
        f"- device copy bandwidth (read + write): {bandwidth_gb_s:,.0f} GB/s; shape {shape}, {dtype}",
        "",
        "| backend | batch | context | ms | K+V read GB/s | of copy bandwidth |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    element = torch.tensor([], dtype=dtype).element_size()
    for name, version in available_backends(device).items():
        if version.startswith("unavailable"):
            continue
        op = resolve_attention_backend(name, device).op
        for batch_size in batches:
            for context in contexts:
                if name == "torch" and batch_size * context > REFERENCE_TOKEN_LIMIT:
                    lines.append(
                        f"| {name} | {batch_size} | {context} | skipped: reference too slow here | | |"
                    )
                    continue
                batch = random_batch(
                    [1] * batch_size, [context] * batch_size, dtype, device, **shape, holes=False
                )
                scale = shape["head_dim"] ** -0.5
                seconds = median_seconds(
                    lambda b=batch, op=op, scale=scale: op(*b.args(b.kv_cache), scale), device, calls
                )
                kv_bytes = 2 * batch_size * context * shape["num_kv_heads"] * shape["head_dim"] * element
                achieved = kv_bytes / seconds / 1e9
                lines.append(
                    f"| {name} | {batch_size} | {context} | {seconds * 1e3:.3f} | {achieved:,.0f} | "
                    f"{achieved / bandwidth_gb_s:.0%} |"
                )
                del batch
    return lines


# -- quantized KV cache (#21) -------------------------------------------------------------------

KV_QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# Against attention over the float cache: half a quantization step per value (int8: amax / 254;
# fp8: 2^-4 of the value) on randn data; tests/test_kv_quant.py has the same bounds.
KV_QUANT_ATOL = {torch.int8: 0.06, torch.float8_e4m3fn: 0.3}


def _quantize_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from compiled_engine.kernels import kv_quant

    out = torch.empty(
        (*cache.shape[:-1], kv_quant.row_width(cache.shape[-1], dtype)), dtype=dtype, device=cache.device
    )
    for start in range(0, cache.shape[1], 1024):  # block chunks: no float copy of a GB cache
        out[:, start : start + 1024] = kv_quant.pack_rows(cache[:, start : start + 1024], dtype)
    return out


def kv_quant_parity_lines(device: torch.device, shape: dict, cases: dict) -> tuple[list[str], list[str]]:
    """Each runnable backend on an int8 / fp8 cache against the reference op on the same cache
    (codes within one step of the reference's, scales equal, outputs as close as on a float cache),
    and its error against the reference over the float cache."""
    from compiled_engine.kernels import kv_quant

    query_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lines = [
        "| KV | backend | case | max abs err vs reference | vs float cache | codes | ok |",
        "|---|---|---|---:|---:|---|---|",
    ]
    failures = []
    atol, rtol = TOLERANCE[query_dtype]
    for name, version in available_backends(device).items():
        if version.startswith("unavailable"):
            continue
        op = resolve_attention_backend(name, device).op
        for label, dtype in KV_QUANT_DTYPES.items():
            for case, (q_lens, c_lens, window, softcap) in cases.items():
                batch = random_batch(q_lens, c_lens, query_dtype, device, **shape, seed=len(case))
                scale = shape["head_dim"] ** -0.5
                cache = _quantize_cache(batch.kv_cache, dtype)
                ref_cache, got_cache = cache.clone(), cache.clone()
                ref = paged_attention_reference(*batch.args(ref_cache), scale, window, softcap).float()
                got = op(*batch.args(got_cache), scale, window, softcap).float()
                plain = paged_attention_reference(*batch.args(batch.kv_cache.clone()), scale, window, softcap)
                err = (got - ref).abs()
                float_err = (got - plain.float()).abs().max().item()
                offset = kv_quant.scale_offset(shape["head_dim"])
                ref_bytes, got_bytes = ref_cache.view(torch.uint8), got_cache.view(torch.uint8)
                code_diff = (got_bytes[..., :offset].int() - ref_bytes[..., :offset].int()).abs().max().item()
                scales_equal = torch.equal(got_bytes[..., offset:], ref_bytes[..., offset:])
                ok = bool((err <= atol + rtol * ref.abs()).all()) and float_err <= KV_QUANT_ATOL[dtype]
                ok = ok and code_diff <= 1 and scales_equal
                if not ok:
                    failures.append(f"{label} {name} {case}")
                lines.append(
                    f"| {label} | {name} | {case} | {err.max().item():.2e} | {float_err:.2e} | "
                    f"max diff {code_diff}, scales {'equal' if scales_equal else 'DIFFER'} | "
                    f"{'ok' if ok else 'FAIL'} |"
                )
    return lines, failures


def kv_quant_timing_lines(
    device: torch.device, shape: dict, batches: tuple[int, ...], contexts: tuple[int, ...], calls: int = 20
) -> list[str]:
    """Decode attention per backend on a bf16 (CPU: float32) cache and on int8 / fp8 caches of the
    same values: ms and the ratio to the unquantized cache (#21's target: int8 <= 0.6x)."""
    query_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lines = [
        f"- shape {shape}, queries {query_dtype}; ratio: quantized ms / {query_dtype} cache ms",
        "",
        "| KV | backend | batch | context | ms | ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, version in available_backends(device).items():
        if version.startswith("unavailable") or name == "torch":
            continue  # the reference's time is dominated by its gathers, not the cache's bytes
        if name == "triton" and device.type != "cuda":
            continue  # the interpreter's times mean nothing (its parity is checked above)
        op = resolve_attention_backend(name, device).op
        for batch_size in batches:
            for context in contexts:
                batch = random_batch(
                    [1] * batch_size, [context] * batch_size, query_dtype, device, **shape, holes=False
                )
                scale = shape["head_dim"] ** -0.5
                caches = {"none": batch.kv_cache}
                caches.update(
                    {label: _quantize_cache(batch.kv_cache, d) for label, d in KV_QUANT_DTYPES.items()}
                )
                times = {
                    label: median_seconds(
                        lambda c=c, op=op, b=batch, s=scale: op(*b.args(c), s), device, calls
                    )
                    for label, c in caches.items()
                }
                for label, seconds in times.items():
                    lines.append(
                        f"| {label} | {name} | {batch_size} | {context} | {seconds * 1e3:.3f} | "
                        f"{seconds / times['none']:.2f} |"
                    )
                del batch, caches
    return lines
