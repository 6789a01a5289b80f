"""Capture, graph passes and (later) compilation of the model's forward step.

`capture_model` turns an HF causal LM plus its paged KV caches into a `CapturedModel` whose
graphs contain no attention other than `torch.ops.compiled_engine.paged_attention`.
"""

from compiled_engine.graphs.capture import CapturedModel, capture_model, default_pass_manager
from compiled_engine.graphs.pass_manager import PassManager, PassReport, PassResult
from compiled_engine.graphs.step_inputs import StepInputs

__all__ = [
    "CapturedModel",
    "PassManager",
    "PassReport",
    "PassResult",
    "StepInputs",
    "capture_model",
    "default_pass_manager",
]
