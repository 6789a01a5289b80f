"""C++ CPU kernels for the ops `cpu_gemv`, `paged_attention_cpu`, `onednn_linear` and the quantized
linears (`cpu_gemv_int8` / `_int4`, `cpu_gemm_int8` / `_int4`), registered with the dispatcher.

Why: a call of one of these ops through its Python implementation costs 4-21 us around a kernel
of ~8 us (bench/test_op_call.py), ~30 calls in every decode step (~100 at 24 layers).
kernels/cpu_ops.cpp implements them in C++ (checks, conversions, packed-weight copies, output,
the kernel call) and registers them for the CPU dispatch key, so a compiled graph's call runs no
Python.

How: the ops' schemas, fake implementations and Python implementations stay in
kernels/cpu_gemv.py, kernels/cpu_attention.py, kernels/onednn_linear.py and
kernels/cpu_gemv_quantized.py. The Python ones are registered as CompositeExplicitAutograd,
which a CPU kernel takes precedence over, so loading this library switches every later call to
C++ and not loading it (no compiler, no torch headers, a failed build) leaves the Python ones
serving.

The library is built at first use into the same folder as the kernels' own libraries
(kernels/cpu_attention_build.py), compiled against the running torch's headers and linked to
the three kernel libraries (found next to it, whatever the folder's path), so the kernels' code is
loaded once, shared with their ctypes callers.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

# These define the ops' schemas, which the library's kernels are registered for.
from compiled_engine.kernels import (  # noqa: F401
    cpu_attention,
    cpu_attention_build,
    cpu_gemv,
    cpu_gemv_quantized,
    onednn_linear,
)
from compiled_engine.kernels.cpu_attention_build import CpuKernelBuildError
from compiled_engine.kernels.widened_linear import widened_dtypes_code

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
# Extra flags on top of cpu_attention_build.FLAGS: torch's headers want C++20.
_STANDARD = "-std=c++20"

logger = logging.getLogger(__name__)
_LOCK = threading.Lock()
_UNTRIED = object()
_result: object = _UNTRIED  # None once registered, else why not (str)
_library: ctypes.CDLL | None = None


def _flags(kernel_libraries: list[Path]) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    include, lib = torch_dir / "include", torch_dir / "lib"
    return [
        _STANDARD,
        # The dequantized weights' maths as torch's (kernels/cpu_ops.cpp, dequantize_rows): a
        # multiply then an add, each rounded, never one fused multiply-add.
        "-ffp-contract=off",
        f"-I{include}",
        f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-DCE_TORCH_VERSION={torch.__version__}",  # in the flags, so in the library's key
        f"-L{kernel_libraries[0].parent}",
        *(f"-l:{path.name}" for path in kernel_libraries),
        "-Wl,-rpath,$ORIGIN",
        f"-L{lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{lib}",
    ]


def build(directory: Path | None = None) -> Path:
    """The library for this torch, compiler and CPU (built with the two kernels' if missing)."""
    kernels = [
        cpu_attention_build.build(directory),
        cpu_attention_build.build(directory, cpu_gemv.SOURCE),
        cpu_attention_build.build(directory, cpu_gemv_quantized.SOURCE),
    ]
    return cpu_attention_build.build(directory, SOURCE, _flags(kernels))


def use_native_ops(directory: Path | None = None) -> str | None:
    """Registers the C++ kernels (building them first if needed), once per process.

    Returns None when they serve the ops, else why not: the ops then keep their Python
    implementations, which give the same results at a higher cost per call (logged once).
    """
    global _result, _library
    with _LOCK:
        if _result is _UNTRIED:
            try:
                path = build(directory)
                torch.ops.load_library(str(path))
                library = ctypes.CDLL(str(path))
                library.ce_cpu_ops_configure(
                    ctypes.c_int(cpu_gemv.gemv_isa()),
                    ctypes.c_int(cpu_gemv_quantized.gemv_path()),
                    ctypes.c_int(cpu_gemv_quantized.bf16_many_rows_path()),
                    ctypes.c_int(widened_dtypes_code()),
                )
                library.ce_cpu_ops_packed_copies.restype = ctypes.c_int64
                _library, _result = library, None
            except (CpuKernelBuildError, OSError, RuntimeError, AttributeError) as exc:
                # AttributeError: a library without the expected entry points.
                _result = f"{type(exc).__name__}: {exc}"
                logger.warning(
                    "the C++ CPU ops (kernels/cpu_ops.cpp) are not available, cpu_gemv, "
                    "paged_attention_cpu and onednn_linear run their Python implementations "
                    "(slower per call): %s",
                    _result,
                )
        return _result if isinstance(_result, str) else None


def packed_copies(op: str = "cpu_gemv") -> int:
    """How many packed copies of live weights the C++ `op` ("cpu_gemv", "onednn_linear" or
    "quantized": the four quantized ops') holds (0 if the library is not loaded)."""
    which = {"cpu_gemv": 0, "onednn_linear": 1, "quantized": 2}[op]
    return 0 if _library is None else int(_library.ce_cpu_ops_packed_copies(ctypes.c_int(which)))
