"""compiled-engine: a compiler-first LLM inference engine."""

from compiled_engine.engine_args import EngineArgs
from compiled_engine.outputs import CompletionOutput, RequestOutput
from compiled_engine.pooling_params import PoolingParams
from compiled_engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "EngineArgs",
    "SamplingParams",
    "PoolingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import compiled_engine.kernels` (or the scheduler alone) must not pull in the
    # whole engine, transformers included.
    if name == "LLM":
        from compiled_engine.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'compiled_engine' has no attribute {name!r}")
