"""Which paged-attention implementation a run uses: the `attention_backend` setting, resolved per device.

- "torch": `compiled_engine::paged_attention`, the pure-torch reference; runs on every device.
- "triton": `compiled_engine::paged_attention_triton` (kernels/triton_attention.py); needs the
  triton package and a CUDA device, or TRITON_INTERPRET=1 to run on the CPU (slow: for tests).
- "cpu": `compiled_engine::paged_attention_cpu` (kernels/cpu_attention.py), a C++ kernel built at
  first use; needs the CPU and a C++ compiler.
- "flashinfer": reserved; resolving it checks its requirements, but no op is wired up yet.
- "auto": on CUDA the best one available (flashinfer once wired, then triton, then torch); on
  the CPU "cpu" when its kernel builds, else "torch".

Every backend computes the same thing (the contract in kernels/paged_attention.py); the version
string goes into compile-cache keys so graphs built for one backend are not reused by another.
torch, cpu and triton also read and write a quantized KV cache (int8 / fp8 rows with per-token,
per-head scales, kernels/kv_quant.py); engine_args.py refuses `kv_cache_dtype` with any other.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flashinfer")

# Flips to True once kernels for flashinfer exist; until then "auto" passes over it.
_FLASHINFER_WIRED = False


class AttentionBackendUnavailableError(RuntimeError):
    """An explicitly requested attention backend cannot run on this machine or device."""


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # Identifies the implementation for compile-cache keys: bumps whenever its numerics change.
    version: str
    # The torch.ops packet to call, with the signature of compiled_engine::paged_attention.
    op: torch._ops.OpOverloadPacket


def resolve_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend `name` stands for on `device`; raises if it is unknown or cannot run there."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    device = torch.device(device)
    if name == "auto":
        name = _auto_backend_name(device)
    if name == "torch":
        return _torch_backend()
    if name == "cpu":
        problem = _cpu_problem(device)
        if problem:
            raise AttentionBackendUnavailableError(problem)
        return _cpu_backend()
    if name == "triton":
        problem = _triton_problem(device)
        if problem:
            raise AttentionBackendUnavailableError(problem)
        return _triton_backend()
    problem = _flashinfer_problem(device)
    if problem:
        raise AttentionBackendUnavailableError(problem)
    raise NotImplementedError("flashinfer backend is not wired yet")


def _auto_backend_name(device: torch.device) -> str:
    # Off CUDA: the CPU kernel where it builds, else the torch op (the Triton interpreter is far
    # too slow to serve).
    if device.type == "cpu":
        problem = _cpu_problem(device)
        if problem is None:
            return "cpu"
        logger.warning("attention_backend auto: using the torch backend, the cpu one cannot run: %s", problem)
        return "torch"
    if device.type != "cuda":
        return "torch"
    if _FLASHINFER_WIRED and _flashinfer_problem(device) is None:
        return "flashinfer"
    if _triton_problem(device) is None:
        return "triton"
    return "torch"


def _torch_backend() -> AttentionBackend:
    from compiled_engine.kernels.paged_attention import PAGED_ATTENTION_VERSION
    from compiled_engine.kernels.reference import REFERENCE_VERSION

    return AttentionBackend(
        "torch", f"{PAGED_ATTENTION_VERSION}+{REFERENCE_VERSION}", torch.ops.compiled_engine.paged_attention
    )


def _cpu_backend() -> AttentionBackend:
    from compiled_engine.kernels.cpu_attention import CPU_ATTENTION_VERSION

    return AttentionBackend("cpu", CPU_ATTENTION_VERSION, torch.ops.compiled_engine.paged_attention_cpu)


def _cpu_problem(device: torch.device) -> str | None:
    """Why the cpu backend cannot run on `device`, or None if it can (its kernel is then built)."""
    from compiled_engine.kernels.cpu_attention import cpu_attention_problem

    return cpu_attention_problem(device)


def _triton_backend() -> AttentionBackend:
    import triton

    # Importing the module registers the op.
    from compiled_engine.kernels.triton_attention import TRITON_ATTENTION_VERSION

    # Triton's own version too: a new compiler can change the kernels' numerics.
    version = f"{TRITON_ATTENTION_VERSION}+triton-{triton.__version__}"
    return AttentionBackend("triton", version, torch.ops.compiled_engine.paged_attention_triton)


def _triton_problem(device: torch.device) -> str | None:
    """Why the triton backend cannot run on `device`, or None if it can."""
    triton = _try_import("triton")
    if triton is None:
        return 'attention_backend="triton" needs the triton package (pip install triton)'
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if _interpreter_requested(triton):
            return None
        return 'attention_backend="triton" on CPU runs only under TRITON_INTERPRET=1'
    return f'attention_backend="triton" needs a CUDA device, got {device.type}'


def _interpreter_requested(triton) -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; it parses the variable as triton itself will
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _flashinfer_problem(device: torch.device) -> str | None:
    """Why the flashinfer backend cannot run on `device`, or None if it can."""
    missing = []
    if device.type != "cuda":
        missing.append(f"the device is {device.type}")
    if _try_import("flashinfer") is None:
        missing.append("flashinfer is not importable")
    if not missing:
        return None
    return (
        'attention_backend="flashinfer" needs a CUDA device and flashinfer-python '
        f"(pip install 'compiled-engine[flashinfer]'): {' and '.join(missing)}"
    )


def _try_import(module: str):
    # Any failure counts as missing: a wheel built for another CUDA can fail with more than ImportError.
    try:
        return importlib.import_module(module)
    except Exception:
        return None
