"""The CPU sampler's greedy pick: each row's argmax, through kernels/cpu_greedy.cpp.

Why: torch's CPU `max(dim=-1)`, which the sampler used for greedy rows (it answers as `argmax`
does, in a fraction of argmax's time over bf16), still went through bf16 logits at about two
billion values a second here: ~0.12 ms a step for 64 rows of bench-small's 4,000-token vocabulary,
~0.5 ms for 256 (docs/performance.md, "The greedy pick in C++"). The kernel finds each row's
maximum and then the first index holding it, 16 values a vector.

Contract: `greedy_pick(logits)` returns what `logits.argmax(dim=-1)` returns (int64 [rows]; ties
to the first index; a row with a NaN answers its first NaN) for a 2-D float32 / bfloat16 /
float16 CPU tensor whose last dimension is contiguous (rows at any stride). The library is built
at first use into the same folder as the other CPU kernels (kernels/cpu_attention_build.py);
where it cannot be built, `greedy_kernel_available()` is False and the sampler keeps torch's
`max(dim=-1)`.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Any

import torch

from compiled_engine.kernels import cpu_attention_build
from compiled_engine.kernels.cpu_attention_build import CpuKernelBuildError

SOURCE = Path(__file__).with_name("cpu_greedy.cpp")
GREEDY_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _declare(library: ctypes.CDLL) -> None:
    function = library.ce_cpu_greedy
    function.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_void_p,
    ]  # fmt: skip
    function.restype = ctypes.c_int


def load(directory: Path | None = None) -> ctypes.CDLL:
    """The loaded library (built first if needed); the same handle for the whole process."""
    return cpu_attention_build.load_library(SOURCE, _declare, directory)


@cache
def greedy_kernel_available() -> bool:
    """Whether the kernel builds and loads here (a C++ compiler is all it needs)."""
    try:
        load()
    except CpuKernelBuildError:
        return False
    return True


@cache
def _kernel() -> Any:
    return load().ce_cpu_greedy


def greedy_pick(logits: torch.Tensor, simd: bool = True) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for 2-D CPU logits (see the module docstring). `simd=False` forces
    the plain loop, as on a CPU without AVX-512 (tests)."""
    if logits.dim() != 2:
        raise ValueError(f"greedy_pick takes [rows, vocab] logits, got shape {tuple(logits.shape)}")
    if logits.device.type != "cpu":
        raise ValueError(f"greedy_pick runs on the CPU, got logits on {logits.device}")
    if logits.dtype not in GREEDY_DTYPES:
        raise ValueError(f"greedy_pick takes float32, bfloat16 or float16 logits, got {logits.dtype}")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("greedy_pick needs at least one vocabulary entry (logits are [rows, 0])")
    if (logits.stride(-1) != 1 and vocab > 1) or (rows > 1 and logits.stride(0) < vocab):
        logits = logits.contiguous()  # the kernel reads rows of unit stride that do not overlap
    out = torch.empty(rows, dtype=torch.int64)
    if rows == 0:
        return out
    row_stride = logits.stride(0) if rows > 1 else vocab
    code = _kernel()(
        logits.data_ptr(), rows, vocab, row_stride, GREEDY_DTYPES[logits.dtype], int(simd),
        torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"greedy_pick: the kernel rejected its arguments (code {code})")
    return out
