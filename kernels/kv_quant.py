"""The quantized KV cache's layout and its torch maths: int8 or fp8 (e4m3) codes with one float32
scale per written token and KV head, for keys and values alike (`kv_cache_dtype`, engine_args.py).

Layout. A quantized cache is still one tensor per layer, [2, blocks, block_size, Hkv, row], of dtype
int8 or float8_e4m3fn, where each (token, head) row packs the head's D codes, zero bytes up to a
multiple of 4, then the row's scale as 4 bytes of float32:

    row = [ code_0 ... code_{D-1} | pad to D4 = round_up(D, 4) | scale (float32) ]   (D4 + 4 bytes)

So a scale lives with its codes: the block pool, prefix caching, preemption, the scratch block and
the compiled graphs see a cache tensor like any other (one input per layer), and a block's scales
move with it. The cache's dtype says whether it is quantized; the ops take the head dim from the
query. `split_rows` gives the codes and the scales as two views of the same storage.

Maths, in float32, the same in every backend (kernels/reference.py, cpu_attention.cpp,
triton_attention.py), so their caches agree code for code:

    amax  = max_d |x_d|
    scale = max(amax / QMAX, FLT_MIN)          QMAX: 127 (int8), 448 (fp8 e4m3's largest finite)
    code  = int8: clamp(round_half_even(x / scale), -127, 127)
            fp8:  e4m3(clamp(x / scale, -448, 448)), rounded to nearest even
    x'    = float(code) * scale

Why per token and head: a scale written with the row needs no calibration and never goes stale
(a per-tensor scale would have to be known before the first token), and one outlier token or head
costs precision only in its own row. Why one scale per row rather than per block: a block is
written a token at a time, and rewriting its codes when a later token raises the max would cost a
read-modify-write of the block on every decode step.
"""

from __future__ import annotations

import torch

# vLLM's names for `kv_cache_dtype` -> the cache's storage dtype ("auto": the model's own dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# Largest code magnitude each quantized storage dtype takes.
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_BYTES = 4  # one float32 per row
_FLT_MIN = torch.finfo(torch.float32).tiny


def canonical_kv_cache_dtype(name: str) -> str:
    """ "auto", "int8" or "fp8" (vLLM's "fp8_e4m3" is fp8); a clear error for anything else."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    return "fp8" if name == "fp8_e4m3" else name


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for this setting: the model's for "auto", else the codes' dtype."""
    chosen = KV_CACHE_DTYPES[canonical_kv_cache_dtype(kv_cache_dtype)]
    return model_dtype if chosen is None else chosen


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def scale_offset(head_dim: int) -> int:
    """Where a row's scale starts, in bytes: after the codes, padded so the float32 is aligned."""
    return -(-head_dim // SCALE_BYTES) * SCALE_BYTES


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension for heads of `head_dim`: D, or the packed row of a quantized cache."""
    return scale_offset(head_dim) + SCALE_BYTES if is_quantized(dtype) else head_dim


def split_rows(rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., D] and float32 scales [...] of packed rows [..., row]: views, not copies.

    The rows' last dimension must be contiguous and every other stride a multiple of 4 bytes,
    which holds for the cache and for anything gathered from it whole."""
    offset = scale_offset(head_dim)
    scales = rows[..., offset : offset + SCALE_BYTES].view(torch.float32).squeeze(-1)
    return rows[..., :head_dim], scales


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., D] in `dtype` and float32 scales [...] of `x` [..., D], one scale per row."""
    qmax = QMAX[dtype]
    x = x.float()
    scale = (x.abs().amax(dim=-1) / qmax).clamp_min(_FLT_MIN)
    scaled = x / scale[..., None]
    if dtype == torch.int8:
        codes = scaled.round().clamp(-qmax, qmax).to(torch.int8)
    else:
        # torch's float32 -> float8_e4m3fn rounds to nearest even; clamped, nothing overflows to NaN.
        codes = scaled.clamp(-qmax, qmax).to(dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., D] from codes [..., D] and their rows' scales [...]."""
    return codes.float() * scales[..., None]


def pack_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` [..., D] quantized into packed rows [..., row] of `dtype` (codes, zero padding, scale)."""
    head_dim = x.shape[-1]
    codes, scales = quantize(x, dtype)
    rows = torch.zeros((*x.shape[:-1], row_width(head_dim, dtype)), dtype=dtype, device=x.device)
    row_codes, row_scales = split_rows(rows, head_dim)
    row_codes.copy_(codes)
    row_scales.copy_(scales)
    return rows


def unpack_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """float32 [..., D] from packed rows [..., row]."""
    return dequantize(*split_rows(rows, head_dim))
