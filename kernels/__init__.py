"""Custom ops and their implementations. Importing this package registers the ops."""

from compiled_engine.kernels import collectives as _collectives  # noqa: F401
from compiled_engine.kernels import cpu_attention as _cpu_attention  # noqa: F401
from compiled_engine.kernels import inline_attention as _inline_attention  # noqa: F401
from compiled_engine.kernels import paged_attention as _paged_attention  # noqa: F401
from compiled_engine.kernels import prefill_attention as _prefill_attention  # noqa: F401
from compiled_engine.kernels.paged_attention import PAGED_ATTENTION_VERSION

# The Triton op is optional: triton ships for Linux x86_64 only, and the torch op runs everywhere.
try:
    import triton  # noqa: F401
except ImportError:
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True

if TRITON_AVAILABLE:
    # Registers torch.ops.compiled_engine.paged_attention_triton; needs no GPU to import.
    from compiled_engine.kernels import triton_attention as _triton_attention  # noqa: F401

__all__ = ["PAGED_ATTENTION_VERSION", "TRITON_AVAILABLE"]
