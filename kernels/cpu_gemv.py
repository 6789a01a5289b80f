"""`compiled_engine::cpu_gemv`: a linear for a few token rows through kernels/cpu_gemv.cpp.

Why: at one to a few rows a linear is a read of its weight, and the step is bound by how fast
the weights stream from memory. torch's `F.linear` at one row streamed a bf16 weight at a
fraction of the machine's bandwidth (slower than fp32 over twice the bytes), and Inductor's
multiply-sum lowering (graphs/passes/gemv_lowering.py) reduces along each output's weight row.
This kernel reads a copy of the weight packed once into the layout the .cpp header describes
(64 output features side by side per k, pairs of k for bf16), on every core (OpenMP over blocks
of 64 features), with AVX-512 BF16's `vdpbf16ps` where the CPU has it, AVX-512F widening
otherwise, AVX2 + FMA + F16C on CPUs without AVX-512, and plain C++ loops on the rest.

As for kernels/onednn_linear.py, the graph keeps the plain weight as its input (compiled
artifacts hold code only, graphs/constant_recipes.py) and `PACKED_GEMV_WEIGHTS` keeps the packed
copy, weakly keyed on the weight tensor and repacked if it changes in place. The library is
built at first use (kernels/cpu_attention_build.py, keyed by source, compiler and CPU).
Which buckets use it is measured per machine (graphs/gemv_policy.py).
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Callable, Container
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

from compiled_engine.kernels import cpu_attention_build
from compiled_engine.kernels.cpu_attention_build import CpuKernelBuildError
from compiled_engine.kernels.source_version import files_version, module_file

SOURCE = Path(__file__).with_name("cpu_gemv.cpp")
# Goes into compile-cache keys and the GEMV policy's version: the op's Python side, its build
# and the C++ source with the headers it includes.
CPU_GEMV_VERSION = files_version(
    module_file(__name__),
    module_file(cpu_attention_build.__name__),
    SOURCE,
    *cpu_attention_build.local_headers(SOURCE),
    SOURCE.with_name("cpu_ops.cpp"),
)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Output features per packed block (kBlock in the .cpp).
BLOCK = 64

# Instruction-set paths of the kernel (`isa` in the .cpp), best last: a CPU that runs one runs every
# one before it.
ISA_PORTABLE, ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16 = 0, 1, 2, 3
# The GEMV's path above them: AVX-512 BF16 plus AMX tiles for bf16 from 4 rows (the .cpp's tile
# section). The GEMV alone runs it (`gemv_isa`); `best_isa` stays the instruction sets the other
# kernels share.
ISA_AMX_TILES = 4
# Rows from which that path runs the tiles (kMinTileRows in the .cpp; fewer take the dot path).
TILE_MIN_ROWS = 4
# Rows from which the AVX2 path runs register tiles, 6 rows x 16 features of sums held over all of
# K (kWideMinRows in the .cpp; fewer take its passes that stream the weight once).
REGISTER_TILE_MIN_ROWS = 8
ISA_NAMES = {
    ISA_PORTABLE: "portable C++",
    ISA_AVX2: "AVX2",
    ISA_AVX512: "AVX-512F",
    ISA_AVX512_BF16: "AVX-512 BF16",
    ISA_AMX_TILES: "AVX-512 BF16 + AMX tiles",
}
_AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})
_AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
_AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "f16c", "fma"})


def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_for_flags(flags: frozenset[str]) -> int:
    """The fastest kernel path a CPU with these /proc/cpuinfo flags runs."""
    if not _AVX512_FLAGS <= flags:
        return ISA_AVX2 if _AVX2_FLAGS <= flags else ISA_PORTABLE
    return ISA_AVX512_BF16 if "avx512_bf16" in flags else ISA_AVX512


@cache
def best_isa() -> int:
    """The fastest kernel path this CPU runs: AVX-512 BF16, AVX-512F, AVX2, else portable loops."""
    return isa_for_flags(_cpu_flags())


@cache
def gemv_isa() -> int:
    """The path the GEMV runs here: `best_isa`, with AMX tiles where the CPU has AMX BF16, the
    library was built with them and Linux grants this process the tile state."""
    isa = best_isa()
    if isa != ISA_AVX512_BF16 or not _AMX_FLAGS <= _cpu_flags():
        return isa
    try:
        tiles = load().ce_cpu_gemv_tiles_available() == 1
    except CpuKernelBuildError:
        return isa
    return ISA_AMX_TILES if tiles else isa


def _declare(library: ctypes.CDLL) -> None:
    function = library.ce_cpu_gemv
    function.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    function.restype = ctypes.c_int
    library.ce_cpu_gemv_tiles_available.argtypes = []
    library.ce_cpu_gemv_tiles_available.restype = ctypes.c_int


def load(directory: Path | None = None) -> ctypes.CDLL:
    """The loaded library (built first if needed); the same handle for the whole process."""
    return cpu_attention_build.load_library(SOURCE, _declare, directory)


def kernel_available(
    load_kernel: Callable[[], object],
    dtypes: Container[torch.dtype],
    dtype: torch.dtype,
    device: torch.device | str,
) -> bool:
    """Whether a built-at-first-use CPU kernel (`load_kernel` builds and loads it) runs `dtype`
    on `device` here: a CPU device, a dtype it takes, and a library that builds and loads."""
    if torch.device(device).type != "cpu" or dtype not in dtypes:
        return False
    try:
        load_kernel()
    except CpuKernelBuildError:
        return False
    return True


def cpu_gemv_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether the kernel can run a `dtype` linear on `device` here (building it if needed, and
    the op's C++ implementation with it where that builds: kernels/cpu_ops.py)."""
    if not kernel_available(load, _DTYPE_CODES, dtype, device):
        return False
    from compiled_engine.kernels.cpu_ops import use_native_ops  # it imports this module

    use_native_ops()
    return True


def pack_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out_features, in_features]) in the kernel's layout (a copy; see the .cpp header).

    With K = in_features rounded up to even: float32/float16 [blocks, K, 64], bfloat16
    [blocks, K / 2, 64, 2]. Features past out_features, and k = in_features when odd, are zeros.
    """
    if weight.dim() != 2:
        raise ValueError(f"a linear weight is 2-D, got shape {tuple(weight.shape)}")
    if weight.dtype not in _DTYPE_CODES or weight.device.type != "cpu":
        raise ValueError(
            f"cpu_gemv packs float32, bfloat16 or float16 CPU weights, got {weight.dtype} on {weight.device}"
        )
    out_features, in_features = weight.shape
    blocks = -(-out_features // BLOCK)
    k_padded = in_features + (in_features & 1)
    with torch.no_grad():
        padded = weight.new_zeros((blocks * BLOCK, k_padded))
        padded[:out_features, :in_features] = weight.detach()
        if weight.dtype == torch.bfloat16:
            packed = padded.view(blocks, BLOCK, k_padded // 2, 2).permute(0, 2, 1, 3)
        else:
            packed = padded.view(blocks, BLOCK, k_padded).permute(0, 2, 1)
        return packed.contiguous()


class PackedGemvWeight(NamedTuple):
    version: int  # the weight's version counter when packed (-1: an inference tensor, never changes)
    packed: torch.Tensor
    packed_ptr: int
    out_features: int
    in_features: int
    dtype_code: int


def _version(weight: torch.Tensor) -> int:
    # An inference tensor has no version counter (reading it raises), and cannot change in place.
    return -1 if weight.is_inference() else weight._version


class PackedGemvWeights:
    """Packed copies of weights, keyed by the weight tensor object (held weakly).

    A plain dict by `id` with a weak reference beside each entry, not a WeakIdKeyDictionary:
    this lookup runs ~25 times per decode step, and the weak-keyed dict's costs several times more.
    """

    def __init__(self) -> None:
        self._copies: dict[int, tuple[weakref.ref[torch.Tensor], PackedGemvWeight]] = {}

    def __len__(self) -> int:
        return len(self._copies)

    def get(self, weight: torch.Tensor) -> PackedGemvWeight:
        """The packed copy of `weight`, made now if there is none or the weight changed since."""
        key = id(weight)
        found = self._copies.get(key)
        if found is not None and found[0]() is weight:
            entry = found[1]
            if entry.version == -1 or entry.version == weight._version:
                return entry
        packed = pack_gemv_weight(weight)
        out_features, in_features = weight.shape
        entry = PackedGemvWeight(
            _version(weight), packed, packed.data_ptr(), out_features, in_features, _DTYPE_CODES[weight.dtype]
        )
        self._copies[key] = (weakref.ref(weight, functools.partial(self._forget, key)), entry)
        return entry

    def _forget(self, key: int, _dead: object = None) -> None:
        found = self._copies.get(key)
        if found is not None and found[0]() is None:  # not a newer weight that reused the id
            del self._copies[key]


PACKED_GEMV_WEIGHTS = PackedGemvWeights()


def cpu_gemv_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: int | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the kernel over `weight`'s packed copy.

    `isa`: the kernel path (ISA_*), by default the best this CPU has; tests force the others.
    """
    entry = PACKED_GEMV_WEIGHTS.get(weight)
    dtype = weight.dtype
    if x.dtype != dtype or (bias is not None and bias.dtype != dtype):
        raise ValueError(f"cpu_gemv needs x, weight and bias of one dtype, got {x.dtype}, {dtype}, "
                         f"{None if bias is None else bias.dtype}")  # fmt: skip
    if x.shape[-1] != entry.in_features:
        raise ValueError(f"cpu_gemv: x has {x.shape[-1]} features, the weight takes {entry.in_features}")
    chosen = gemv_isa() if isa is None else isa
    if chosen > gemv_isa():
        raise ValueError(f"cpu_gemv: this CPU cannot run the {ISA_NAMES.get(chosen, chosen)} path")
    rows = x.reshape(-1, entry.in_features)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < entry.in_features):
        rows = rows.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    out = torch.empty((*x.shape[:-1], entry.out_features), dtype=dtype)
    code = load().ce_cpu_gemv(
        rows.data_ptr(), rows.stride(0), rows.shape[0], entry.packed_ptr,
        None if bias is None else bias.data_ptr(), out.data_ptr(),
        entry.in_features, entry.out_features, entry.dtype_code, chosen, torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"cpu_gemv: the kernel rejected its arguments (code {code})")
    return out


def _cpu_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The graphs' case, with the checks above reduced to what it needs (this runs ~25 times a
    # step): a contiguous x of the weight's dtype and no bias. Anything else takes the checked path.
    if x.device.type != "cpu" or weight.device.type != "cpu":
        # Registered as CompositeExplicitAutograd (for every device key): the kernel reads host memory.
        raise ValueError(f"cpu_gemv runs on CPU tensors, got {x.device} and {weight.device}")
    entry = PACKED_GEMV_WEIGHTS.get(weight)
    in_features = entry.in_features
    if bias is not None or x.dtype != weight.dtype or not x.is_contiguous() or x.shape[-1] != in_features:
        return cpu_gemv_linear(x, weight, bias)
    out = x.new_empty((*x.shape[:-1], entry.out_features))
    code = _kernel()(
        x.data_ptr(), in_features, x.numel() // in_features, entry.packed_ptr, None, out.data_ptr(),
        in_features, entry.out_features, entry.dtype_code, gemv_isa(), torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"cpu_gemv: the kernel rejected its arguments (code {code})")
    return out


@cache
def _kernel() -> Any:
    return load().ce_cpu_gemv


def _cpu_gemv_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# The low-level torch.library API, not custom_op, for the same reason as onednn_linear: ~25 calls
# per step, and custom_op's Python wrapper costs several times this dispatch per call. The Python
# implementation is CompositeExplicitAutograd: kernels/cpu_ops.cpp's CPU kernel, once loaded
# (kernels/cpu_ops.py), takes precedence over it.
_LIBRARY = torch.library.Library("compiled_engine", "FRAGMENT")
_LIBRARY.define("cpu_gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("cpu_gemv", _cpu_gemv, "CompositeExplicitAutograd")
torch.library.register_fake("compiled_engine::cpu_gemv", _cpu_gemv_fake, lib=_LIBRARY)

# `F.linear(x, weight, bias)` through kernels/cpu_gemv.cpp over `weight`'s packed copy.
cpu_gemv = torch.ops.compiled_engine.cpu_gemv.default
