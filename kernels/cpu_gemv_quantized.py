"""`compiled_engine::cpu_gemv_int8` / `cpu_gemv_int4`: quantized linears for a few token rows
through kernels/cpu_gemv_quantized.cpp, the C++ GEMV's int8 and int4 weight variants; and
`cpu_gemm_int8` / `cpu_gemm_int4`, the same maths for many rows: on the kernel's tile path (each
64-output block dequantized to bf16 once and multiplied with every row on AMX; bf16 activations on
a CPU with AMX BF16), on CPUs with AVX2 but no AVX-512, from 8 rows, its widen-once path (a
block's chunk widened in L1 once per 64 rows, to int16 for bf16 / fp16 x or dequantized to float32
for float32 x, and multiplied with every row; int4 with bf16 / fp16 x rounds x to int8 per 32 inputs
there, as llama.cpp's Q4_0 prompt does), else the GEMV's loops;
from DEQUANTIZE_ROWS rows, the whole weight dequantized once and torch's GEMM instead of the kernel
(except int4 on the AVX2 int8-x path, which stays faster).

Same operands as torch's kernels' ops (kernels/quantized_linear.py), so a graph pass swaps one for
the other (graphs/passes/cpu_gemv_quantized.py) in the buckets where the GEMV policy measured this
one faster (graphs/gemv_policy.py). As for kernels/cpu_gemv.py, the graph keeps the canonical
quantized tensors (kernels/weight_quantization.py) and `PACKED_QUANTIZED_WEIGHTS` keeps the copy
packed in the kernel's 64-feature blocks (the .cpp header), weakly keyed on the quantized weight
and repacked if it changes in place. The library is built at first use
(kernels/cpu_attention_build.py, keyed by source, compiler and CPU).

The ops' implementations here are the fallback: where kernels/cpu_ops.cpp builds, its C++ ones
(same checks, same results, their own packed copies) serve every call (kernels/cpu_ops.py).
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from compiled_engine.kernels import cpu_attention_build
from compiled_engine.kernels.cpu_gemv import (
    BLOCK,
    ISA_AVX2,
    ISA_AVX512,
    ISA_AVX512_BF16,
    ISA_NAMES,
    best_isa,
    kernel_available,
)
from compiled_engine.kernels.quantized_linear import int4_linear_fake, int8_linear_fake
from compiled_engine.kernels.source_version import files_version, module_file
from compiled_engine.kernels.weight_quantization import QUANTIZED_DTYPES, QuantizedWeight, dequantize
from compiled_engine.kernels.widened_linear import dense_linear

SOURCE = Path(__file__).with_name("cpu_gemv_quantized.cpp")
CPU_GEMV_QUANTIZED_VERSION = files_version(
    module_file(__name__),
    module_file(cpu_attention_build.__name__),
    SOURCE,
    *cpu_attention_build.local_headers(SOURCE),
)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# From this many rows (a prompt's) the many-rows ops dequantize the weight once into x's dtype and
# run torch's GEMM (oneDNN) instead of the kernel: its tile path re-reads every row of x for each
# 64-output block, and past a few hundred rows x leaves L2 (docs/quantization.md, "How it runs").
# kDequantizeRows in kernels/cpu_ops.cpp, which does the same in C++.
DEQUANTIZE_ROWS = 512

# On AVX2 (no AVX-512) ce_cpu_gemm_int4 multiplies bf16 / fp16 x rounded to int8, per
# INT8_X_INPUTS inputs of a row, from INT8_X_ROWS rows, where the groups are a multiple of
# INT8_X_INPUTS (kDequantizeOnceRows and kQuadChunkK in the .cpp; docs/quantization.md says why).
INT8_X_ROWS = 8
INT8_X_INPUTS = 32

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _declare(library: ctypes.CDLL) -> None:
    library.ce_cpu_gemv_int8.argtypes = [_P, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _INT, _INT, _INT]
    library.ce_cpu_gemv_int8.restype = _INT
    library.ce_cpu_gemv_int4.argtypes = [
        _P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _INT, _INT, _INT, _P,
    ]  # fmt: skip
    library.ce_cpu_gemv_int4.restype = _INT
    library.ce_cpu_gemm_int8.argtypes = library.ce_cpu_gemv_int8.argtypes
    library.ce_cpu_gemm_int8.restype = _INT
    library.ce_cpu_gemm_int4.argtypes = library.ce_cpu_gemv_int4.argtypes
    library.ce_cpu_gemm_int4.restype = _INT
    library.ce_cpu_gemm_tiles_available.argtypes = []
    library.ce_cpu_gemm_tiles_available.restype = _INT
    library.ce_cpu_gemm_avx512_available.argtypes = []
    library.ce_cpu_gemm_avx512_available.restype = _INT


def load(directory: Path | None = None) -> ctypes.CDLL:
    """The loaded library (built first if needed); the same handle for the whole process."""
    return cpu_attention_build.load_library(SOURCE, _declare, directory)


def cpu_gemv_quantized_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether the kernels can run quantized linears with `dtype` activations on `device` here
    (building them if needed, and the ops' C++ implementations with them where those build:
    kernels/cpu_ops.py)."""
    if not kernel_available(load, QUANTIZED_DTYPES, dtype, device):
        return False
    from compiled_engine.kernels.cpu_ops import use_native_ops  # it imports this module

    use_native_ops()
    return True


def gemv_path() -> int:
    """The path the quantized GEMV takes by default here (the AVX-512 BF16 dot products are the
    float GEMV's only: the weights are integers)."""
    return min(best_isa(), ISA_AVX512)


def bf16_many_rows_path() -> int:
    """The path the many-rows ops take by default for bf16 activations: the AMX tiles where they
    run, else the AVX-512 widen-once path, else the GEMV's."""
    if tiles_available():
        return ISA_AMX
    if avx512_many_rows_available():
        return ISA_AVX512_BF16
    return gemv_path()


# The tile path's `isa` (above the GEMV's ISA_* of kernels/cpu_gemv.py): AMX BF16.
ISA_AMX = 4


@cache
def tiles_available() -> bool:
    """Whether the tile path runs here: the library built with AMX BF16 and the OS granting its state."""
    try:
        return bool(load().ce_cpu_gemm_tiles_available())
    except (OSError, RuntimeError):
        return False


def many_rows_path_available() -> bool:
    """Whether the many-rows ops take the AVX2 widen-once path here (from 8 rows): AVX2 is this CPU's
    best path (CPUs with AVX-512 take the tiles, the AVX-512 widen-once path or the GEMV's loops
    there)."""
    return best_isa() == ISA_AVX2


@cache
def avx512_many_rows_available() -> bool:
    """Whether the many-rows ops' AVX-512 widen-once path (ISA_AVX512_BF16: VNNI for int8, BF16 dot
    products for int4; bf16 activations) runs here: the CPU has AVX-512 BF16 and the library was
    built with VNNI and BF16. It is their default for bf16 x where the AMX tiles are not."""
    if best_isa() < ISA_AVX512_BF16:
        return False
    try:
        return bool(load().ce_cpu_gemm_avx512_available())
    except (OSError, RuntimeError):
        return False


def cpu_gemm_quantized_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether `cpu_gemm_int8` / `_int4` have a many-rows path for `dtype` activations on `device`:
    the tiles (bf16, AMX), the AVX-512 widen-once path (bf16) or the AVX2 dequantize-once path (any
    activation dtype)."""
    if not cpu_gemv_quantized_available(dtype, device):
        return False
    bf16_path = tiles_available() or avx512_many_rows_available()
    return (dtype == torch.bfloat16 and bf16_path) or many_rows_path_available()


def _blocks(rows: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
    """[N, ...] -> [ceil(N / 64) * 64, ...], padded with `fill`."""
    n = rows.shape[0]
    padded = -(-n // BLOCK) * BLOCK
    if padded == n:
        return rows
    return F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, padded - n), value=fill)


def pack_int8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] and scales [N] -> packed [blocks, K, 64] int8 and scales [blocks, 64] float32."""
    with torch.no_grad():
        q = _blocks(qweight)
        packed = q.view(-1, BLOCK, q.shape[1]).permute(0, 2, 1).contiguous()
        return packed, _blocks(scales.float()[:, None]).view(-1, BLOCK).contiguous()


def pack_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, ...]:
    """int4 nibbles [N, K / 2], scales and zeros [N, G] -> packed [blocks, K / 2, 64] uint8 (the same
    bytes, features side by side), scales and offsets (zero - 8 * scale) [blocks, G, 64] float32,
    and for bf16 scales and zeros also scale_zero [blocks, G, 64] int32: each scale's bf16 bits in
    the low half, its zero's in the high one (what the integer and AVX-512 paths stream: half the
    bytes)."""
    with torch.no_grad():
        q = _blocks(qweight, fill=0x88)  # padded features: q = 8 everywhere, scale 0, offset 0
        packed = q.view(-1, BLOCK, q.shape[1]).permute(0, 2, 1).contiguous()
        s, z = scales.float(), zeros.float()
        offsets = z - 8 * s
        groups = s.shape[1]
        as_blocks = lambda t: _blocks(t).view(-1, BLOCK, groups).permute(0, 2, 1).contiguous()  # noqa: E731
        if scales.dtype != torch.bfloat16 or zeros.dtype != torch.bfloat16:
            return packed, as_blocks(s), as_blocks(offsets)
        bits = lambda t: t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # noqa: E731
        scale_zero = bits(scales) | (bits(zeros) << 16)
        return packed, as_blocks(s), as_blocks(offsets), as_blocks(scale_zero)


class PackedQuantizedWeight(NamedTuple):
    version: tuple[int, ...]  # the operands' version counters when packed (-1: inference tensors)
    tensors: tuple[torch.Tensor, ...]  # packed weight, scales[, offsets[, scale_zero]]: kept alive for
    # the pointers
    pointers: tuple[int, ...]
    out_features: int
    in_features: int


def _version(tensor: torch.Tensor) -> int:
    return -1 if tensor.is_inference() else tensor._version


class PackedQuantizedWeights:
    """Packed copies of quantized weights, keyed by the `qweight` tensor object (held weakly)."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[weakref.ref[torch.Tensor], PackedQuantizedWeight]] = {}

    def __len__(self) -> int:
        return len(self._copies)

    def get(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None = None,
        group_size: int | None = None,
    ) -> PackedQuantizedWeight:
        key = id(qweight)
        version = tuple(_version(t) for t in (qweight, scales, *(() if zeros is None else (zeros,))))
        found = self._copies.get(key)
        if found is not None and found[0]() is qweight and found[1].version == version:
            return found[1]
        if zeros is None:
            tensors: tuple[torch.Tensor, ...] = pack_int8(qweight, scales)
            in_features = qweight.shape[1]
        else:
            assert group_size is not None
            tensors = pack_int4(qweight, scales, zeros, group_size)
            in_features = 2 * qweight.shape[1]
        entry = PackedQuantizedWeight(
            version, tensors, tuple(t.data_ptr() for t in tensors), qweight.shape[0], in_features
        )
        self._copies[key] = (weakref.ref(qweight, functools.partial(self._forget, key)), entry)
        return entry

    def _forget(self, key: int, _dead: object = None) -> None:
        found = self._copies.get(key)
        if found is not None and found[0]() is None:
            del self._copies[key]


PACKED_QUANTIZED_WEIGHTS = PackedQuantizedWeights()


def gemm_int4_rounds_x_to_int8(x: torch.Tensor, group_size: int, isa: int | None = None) -> bool:
    """Whether `cpu_gemm_int4_linear(x, ..., group_size, isa=isa)` multiplies x rounded to int8
    (`int8_x_reference`) rather than x: its AVX2 path for bf16 / fp16 x from INT8_X_ROWS rows (at
    any count: it keeps the kernel past DEQUANTIZE_ROWS too)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if isa is not None and isa >= ISA_AMX:
        return False
    path = _tile_path(x, isa, gemv_path() if isa is None else min(isa, ISA_AVX512))
    return rows >= INT8_X_ROWS and _int8_x_path(path, x, group_size)


def _int8_x_path(path: int, x: torch.Tensor, group_size: int) -> bool:
    """The kernel's many-rows path `path` rounds x to int8 for this int4 weight: AVX2, bf16 / fp16
    x, groups a multiple of INT8_X_INPUTS. From DEQUANTIZE_ROWS rows it still beats dequantizing
    (the 0.5B shape's layer at 512 rows: 3-5x, docs/performance.md), so it keeps the kernel."""
    return path == ISA_AVX2 and x.dtype != torch.float32 and group_size % INT8_X_INPUTS == 0


def int8_x_reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What that path computes, in float32 (a reference for tests): each INT8_X_INPUTS inputs of a
    row rounded to the nearest multiple of s = max|x| / 127 (ties to even, as the kernel's
    round_rows) times the nibbles' part of the weight, q * scale, plus x itself times the
    offsets, zero - 8 * scale: the kernel adds offset x the group's sum of x unrounded."""
    chunks = x.float().reshape(*x.shape[:-1], -1, INT8_X_INPUTS)
    amax = chunks.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    rounded = (torch.round(chunks * (1 / scale)) * scale).reshape(x.shape)
    assert weight.zeros is not None and weight.group_size is not None
    scales = weight.scales.float().repeat_interleave(weight.group_size, dim=1)
    offsets = weight.zeros.float().repeat_interleave(weight.group_size, dim=1) - 8 * scales
    return F.linear(rounded, dequantize(weight) - offsets) + F.linear(x.float(), offsets)


def gemm_int4_reference(x: torch.Tensor, weight: QuantizedWeight, isa: int | None = None) -> torch.Tensor:
    """What `cpu_gemm_int4_linear(x, ..., isa=isa)` computes without its bias, in float32 (a
    reference for tests): `int8_x_reference` where the call rounds x to int8, else x times the
    dequantized weight."""
    assert weight.group_size is not None
    if gemm_int4_rounds_x_to_int8(x, weight.group_size, isa):
        return int8_x_reference(x, weight)
    return F.linear(x.float(), dequantize(weight))


def _checked_rows(x: torch.Tensor, in_features: int, isa: int | None) -> tuple[torch.Tensor, int]:
    if x.device.type != "cpu":
        # Registered as CompositeExplicitAutograd (for every device key): the kernel reads host memory.
        raise ValueError(f"cpu_gemv_quantized runs on CPU tensors, got {x.device}")
    if x.dtype not in _DTYPE_CODES:
        raise ValueError(f"cpu_gemv_quantized takes float32, bfloat16 or float16 activations, got {x.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"cpu_gemv_quantized: x has {x.shape[-1]} features, the weight takes {in_features}")
    if isa is not None and isa > best_isa():
        raise ValueError(f"cpu_gemv_quantized: this CPU cannot run the {ISA_NAMES.get(isa, isa)} path")
    rows = x.reshape(-1, in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    # The kernels have AVX-512F, AVX2 and portable paths (no BF16 dot product: the weights are integers).
    return rows, gemv_path() if isa is None else min(isa, ISA_AVX512)


def _paths(x: torch.Tensor, in_features: int, isa: int | None, tiles: bool) -> tuple[torch.Tensor, int]:
    """x's rows and the kernel path: the GEMV's (_checked_rows), or for the many-rows ops _tile_path's."""
    forced_tiles = tiles and isa is not None and isa >= ISA_AMX
    rows, path = _checked_rows(x, in_features, None if forced_tiles else isa)
    return rows, _tile_path(x, isa, path) if tiles else path


def _tile_path(x: torch.Tensor, isa: int | None, fallback: int) -> int:
    """The many-rows ops' path: by default the tiles where they run, else (bf16 x) the AVX-512
    widen-once path where it runs, else `fallback` (the GEMV's path); `isa` forces one."""
    if isa is not None and isa >= ISA_AMX:
        if not tiles_available():
            raise ValueError("cpu_gemm_quantized: this CPU (or build) cannot run the AMX tile path")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"cpu_gemm_quantized: the AMX tile path takes bfloat16 x, not {x.dtype}")
        return ISA_AMX
    if isa == ISA_AVX512_BF16:
        if not avx512_many_rows_available():
            raise ValueError("cpu_gemm_quantized: this CPU (or build) cannot run the AVX-512 widen-once path")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"cpu_gemm_quantized: the AVX-512 path takes bfloat16 x, not {x.dtype}")
        return ISA_AVX512_BF16
    if isa is None and x.dtype == torch.bfloat16:
        return bf16_many_rows_path()
    return fallback


def _bias(bias: torch.Tensor | None, x: torch.Tensor) -> Any:
    if bias is None:
        return None
    if bias.dtype != x.dtype:
        raise ValueError(f"cpu_gemv_quantized: bias is {bias.dtype}, x is {x.dtype}")
    return bias.contiguous()


def cpu_gemv_int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    isa: int | None = None,
) -> torch.Tensor:
    """x @ (qweight * scales[:, None])^T (+ bias) through the kernel; `isa` forces a path (tests)."""
    return _int8_linear(x, qweight, scales, bias, isa, tiles=False)


def cpu_gemm_int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    isa: int | None = None,
) -> torch.Tensor:
    """`cpu_gemv_int8_linear` for many rows: the tile path (ISA_AMX) where it runs; `isa` forces one."""
    return _int8_linear(x, qweight, scales, bias, isa, tiles=True)


def _int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    isa: int | None,
    tiles: bool,
) -> torch.Tensor:
    rows, path = _paths(x, qweight.shape[-1], isa, tiles)
    bias = _bias(bias, x)
    if tiles and isa is None and rows.shape[0] >= DEQUANTIZE_ROWS:
        return dense_linear(x, dequantize(QuantizedWeight(qweight, scales, None, None), x.dtype), bias)
    entry = PACKED_QUANTIZED_WEIGHTS.get(qweight, scales)
    out = torch.empty((*x.shape[:-1], entry.out_features), dtype=x.dtype)
    packed, packed_scales = entry.pointers
    code = (_int8_tiles_kernel() if tiles else _int8_kernel())(
        rows.data_ptr(), entry.in_features, rows.shape[0], packed, packed_scales,
        None if bias is None else bias.data_ptr(), out.data_ptr(), entry.in_features, entry.out_features,
        _DTYPE_CODES[x.dtype], path, torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"cpu_gemv_int8: the kernel rejected its arguments (code {code})")
    return out


def cpu_gemv_int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    isa: int | None = None,
) -> torch.Tensor:
    """x @ dequantized(int4 qweight)^T (+ bias) through the kernel; `isa` forces a path (tests)."""
    return _int4_linear(x, qweight, scales, zeros, group_size, bias, isa, tiles=False)


def cpu_gemm_int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    isa: int | None = None,
) -> torch.Tensor:
    """`cpu_gemv_int4_linear` for many rows: the tile path (ISA_AMX) where it runs; `isa` forces one."""
    return _int4_linear(x, qweight, scales, zeros, group_size, bias, isa, tiles=True)


def _int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    isa: int | None,
    tiles: bool,
) -> torch.Tensor:
    rows, path = _paths(x, 2 * qweight.shape[-1], isa, tiles)
    bias = _bias(bias, x)
    if tiles and isa is None and rows.shape[0] >= DEQUANTIZE_ROWS and not _int8_x_path(path, x, group_size):
        return dense_linear(x, dequantize(QuantizedWeight(qweight, scales, zeros, group_size), x.dtype), bias)
    entry = PACKED_QUANTIZED_WEIGHTS.get(qweight, scales, zeros, group_size)
    out = torch.empty((*x.shape[:-1], entry.out_features), dtype=x.dtype)
    packed, packed_scales, offsets, *scale_zero = entry.pointers
    code = (_int4_tiles_kernel() if tiles else _int4_kernel())(
        rows.data_ptr(), entry.in_features, rows.shape[0], packed, packed_scales, offsets, group_size,
        None if bias is None else bias.data_ptr(), out.data_ptr(), entry.in_features, entry.out_features,
        _DTYPE_CODES[x.dtype], path, torch.get_num_threads(), scale_zero[0] if scale_zero else None,
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"cpu_gemv_int4: the kernel rejected its arguments (code {code})")
    return out


@cache
def _int8_kernel() -> Any:
    return load().ce_cpu_gemv_int8


@cache
def _int4_kernel() -> Any:
    return load().ce_cpu_gemv_int4


@cache
def _int8_tiles_kernel() -> Any:
    return load().ce_cpu_gemm_int8


@cache
def _int4_tiles_kernel() -> Any:
    return load().ce_cpu_gemm_int4


def _int8_op(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return cpu_gemv_int8_linear(x, qweight, scales, bias)


def _int4_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return cpu_gemv_int4_linear(x, qweight, scales, zeros, group_size, bias)


def _gemm_int8_op(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return cpu_gemm_int8_linear(x, qweight, scales, bias)


def _gemm_int4_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return cpu_gemm_int4_linear(x, qweight, scales, zeros, group_size, bias)


_LIBRARY = torch.library.Library("compiled_engine", "FRAGMENT")
_LIBRARY.define("cpu_gemv_int8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor")
_LIBRARY.define(
    "cpu_gemv_int4(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size, "
    "Tensor? bias) -> Tensor"
)
_LIBRARY.define("cpu_gemm_int8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias) -> Tensor")
_LIBRARY.define(
    "cpu_gemm_int4(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size, "
    "Tensor? bias) -> Tensor"
)
# The Python implementations are CompositeExplicitAutograd, as kernels/cpu_gemv.py's: where the
# ops' C++ implementations build (kernels/cpu_ops.py), their CPU kernels take precedence and a
# graph's call runs no Python (bench/test_op_call.py: ~7 us a call less, ~100 calls a token at the
# 0.5B shape).
_LIBRARY.impl("cpu_gemv_int8", _int8_op, "CompositeExplicitAutograd")
_LIBRARY.impl("cpu_gemv_int4", _int4_op, "CompositeExplicitAutograd")
torch.library.register_fake("compiled_engine::cpu_gemv_int8", int8_linear_fake, lib=_LIBRARY)
torch.library.register_fake("compiled_engine::cpu_gemv_int4", int4_linear_fake, lib=_LIBRARY)
_LIBRARY.impl("cpu_gemm_int8", _gemm_int8_op, "CompositeExplicitAutograd")
_LIBRARY.impl("cpu_gemm_int4", _gemm_int4_op, "CompositeExplicitAutograd")
torch.library.register_fake("compiled_engine::cpu_gemm_int8", int8_linear_fake, lib=_LIBRARY)
torch.library.register_fake("compiled_engine::cpu_gemm_int4", int4_linear_fake, lib=_LIBRARY)

# The same maths as kernels/quantized_linear.py's int8_weight_linear / int4_weight_linear.
cpu_gemv_int8 = torch.ops.compiled_engine.cpu_gemv_int8.default
cpu_gemv_int4 = torch.ops.compiled_engine.cpu_gemv_int4.default
# ... for many rows, on the tile path where it runs (module docstring).
cpu_gemm_int8 = torch.ops.compiled_engine.cpu_gemm_int8.default
cpu_gemm_int4 = torch.ops.compiled_engine.cpu_gemm_int4.default
