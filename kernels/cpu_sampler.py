"""The CPU sampler's per-row picks, through kernels/cpu_sampler.cpp: greedy rows' argmax and
temperature rows' draw.

Why: torch's CPU ops went through a step's logits several times at one to two billion values a
second. Greedy rows: `max(dim=-1)` (argmax's answer in a fraction of argmax's time over bf16) took
0.13–0.23 ms a step for 64 rows of bench-small's 4,000-token vocabulary. Temperature rows: `amax`,
subtract, divide, `softmax`, `cumsum` and `searchsorted` took 1.8–2.0 ms for 256 rows of 4,096
(docs/performance.md, "The sampler's picks in C++"). The kernels read each row a few times in
vector passes instead.

Contract:
- `greedy_pick(logits)` returns what `logits.argmax(dim=-1)` returns (int64 [rows]; ties to the
  first index; a row with a NaN answers its first NaN).
- `temperature_draw(logits, temperature, uniform)` returns one token per row drawn as
  worker/sampler.py's `categorical_draw(target_probs(logits))` draws it with no top-k, top-p or
  min-p: the first index whose running sum of exp((x - max) / t) exceeds uniform * the row's total
  (the sums in another order than torch's, so a draw can differ where u * total falls within
  rounding of a boundary: the same distribution). A row with a NaN answers its argmax, a row of
  -inf answers 0.
- Both take 2-D float32 / bfloat16 / float16 CPU logits whose last dimension is contiguous (rows
  at any stride; anything else is copied first). The library is built at first use into the same
  folder as the other CPU kernels (kernels/cpu_attention_build.py); where it cannot be built,
  `sampler_kernels_available()` is False and the sampler keeps torch's ops.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import Any

import torch

from compiled_engine.kernels import cpu_attention_build
from compiled_engine.kernels.cpu_attention_build import CpuKernelBuildError

SOURCE = Path(__file__).with_name("cpu_sampler.cpp")
SAMPLER_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _declare(library: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.ce_cpu_greedy.argtypes = [p, i64, i64, i64, i32, i32, i32, p]
    library.ce_cpu_greedy.restype = i32
    library.ce_cpu_temperature_draw.argtypes = [p, i64, i64, i64, i32, p, p, i32, i32, p]
    library.ce_cpu_temperature_draw.restype = i32
    library.ce_cpu_sampler_simd.argtypes = []
    library.ce_cpu_sampler_simd.restype = i32


def load(directory: Path | None = None) -> ctypes.CDLL:
    """The loaded library (built first if needed); the same handle for the whole process."""
    return cpu_attention_build.load_library(SOURCE, _declare, directory)


def _address(function: Any) -> int:
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address


def temperature_draw_kernel_address() -> int:
    """ce_cpu_temperature_draw's address, for a step plan's multi-step runs whose rows sample."""
    return _address(_library().ce_cpu_temperature_draw)


def greedy_kernel_address() -> int:
    """ce_cpu_greedy's address, for C++ that picks tokens itself (a step plan's multi-step runs)."""
    return _address(_library().ce_cpu_greedy)


@cache
def sampler_kernels_available() -> bool:
    """Whether the kernels build and load here (a C++ compiler is all they need)."""
    try:
        load()
    except CpuKernelBuildError:
        return False
    return True


def serves(logits: torch.Tensor) -> bool:
    """Whether the kernels take these logits as they are: 2-D, on the CPU, of a dtype they read,
    with a vocabulary, and the library loads here (the sampler's test before calling them)."""
    return (
        logits.device.type == "cpu"
        and logits.dtype in SAMPLER_DTYPES
        and logits.dim() == 2
        and logits.shape[1] > 0
        and sampler_kernels_available()
    )


@cache
def _library() -> Any:
    return load()


def _rows_of(logits: torch.Tensor, name: str) -> torch.Tensor:
    """`logits` checked, with a unit stride along the vocabulary and rows that do not overlap."""
    if logits.dim() != 2:
        raise ValueError(f"{name} takes [rows, vocab] logits, got shape {tuple(logits.shape)}")
    if logits.device.type != "cpu":
        raise ValueError(f"{name} runs on the CPU, got logits on {logits.device}")
    if logits.dtype not in SAMPLER_DTYPES:
        raise ValueError(f"{name} takes float32, bfloat16 or float16 logits, got {logits.dtype}")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError(f"{name} needs at least one vocabulary entry (logits are [rows, 0])")
    if (logits.stride(-1) != 1 and vocab > 1) or (rows > 1 and logits.stride(0) < vocab):
        logits = logits.contiguous()
    return logits


def _row_stride(logits: torch.Tensor) -> int:
    return logits.stride(0) if logits.shape[0] > 1 else logits.shape[1]


def greedy_pick(logits: torch.Tensor, simd: bool = True) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for 2-D CPU logits (see the module docstring). `simd=False` forces
    the plain loops, as on a CPU without AVX-512 or AVX2 (tests)."""
    logits = _rows_of(logits, "greedy_pick")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows == 0:
        return out
    code = _library().ce_cpu_greedy(
        logits.data_ptr(), rows, vocab, _row_stride(logits), SAMPLER_DTYPES[logits.dtype], int(simd),
        torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"greedy_pick: the kernel rejected its arguments (code {code})")
    return out


def temperature_draw(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, simd: bool = True
) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), drawn at `uniform` (see the module
    docstring): `temperature` and `uniform` are float32 [rows], temperatures positive and finite."""
    logits = _rows_of(logits, "temperature_draw")
    rows, vocab = logits.shape
    for name, values in (("temperature", temperature), ("uniform", uniform)):
        if values.shape != (rows,) or values.dtype != torch.float32 or values.device.type != "cpu":
            raise ValueError(
                f"temperature_draw needs {name} as float32 [{rows}] on the CPU, got "
                f"{values.dtype} {tuple(values.shape)} on {values.device}"
            )
    if rows and not bool(((temperature > 0) & temperature.isfinite()).all()):
        raise ValueError(f"temperature_draw needs positive finite temperatures, got {temperature.tolist()}")
    temperature, uniform = temperature.contiguous(), uniform.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    if rows == 0:
        return out
    code = _library().ce_cpu_temperature_draw(
        logits.data_ptr(), rows, vocab, _row_stride(logits), SAMPLER_DTYPES[logits.dtype],
        temperature.data_ptr(), uniform.data_ptr(), int(simd), torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"temperature_draw: the kernel rejected its arguments (code {code})")
    return out
