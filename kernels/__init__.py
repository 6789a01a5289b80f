"""Custom ops and their implementations. Importing this package registers the ops."""

from compiled_engine.kernels import inline_attention as _inline_attention  # noqa: F401
from compiled_engine.kernels import paged_attention as _paged_attention  # noqa: F401
from compiled_engine.kernels.paged_attention import PAGED_ATTENTION_VERSION

__all__ = ["PAGED_ATTENTION_VERSION"]
