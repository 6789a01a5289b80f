"""Capture an unmodified HF causal LM into FX graphs whose every attention is the paged op.

`capture_model(model, kv_caches)` returns a `CapturedModel`; calling it with a `StepInputs`
runs one forward step over all scheduled tokens (flattened into one [1, T] row) and returns
the logits of the `logits_indices` rows.

How: the step function calls the model with `use_cache=False`, the step's positions and the
paged-attention metadata as extra keyword arguments, under `torch.compile(fullgraph=True,
dynamic=True)` with our own Dynamo backend. Attention reaches the graph as
`torch.ops.compiled_engine.paged_attention` through transformers' AttentionInterface
(graphs/attention_interface.py); a model that calls SDPA itself is rewritten by the
lower_sdpa pass. The backend runs the pass manager's capture-time passes
(graphs/pass_pipeline.py) on each GraphModule Dynamo hands it and returns it eager — or hands it
to `graph_compiler` (Inductor) when one is given, after the passes.

With `fuse_linears=True` the pipeline first freezes the weights into graph constants
(graphs/passes/freeze_parameters.py) and later fuses sibling linears (q/k/v, gate/up) into one
GEMM each (graphs/passes/fuse_linears.py), all graphs of one model sharing one copy of the
concatenated weights. The frozen graph takes fewer inputs: `graph_compiler`
gets that graph and only its kept example inputs, and the placeholders left on the graph (the
ones a CallingConvention reads) are exactly the inputs the graph still takes.

Graphs per model: Dynamo specialises sizes 0 and 1 of every dynamic dimension (T, S, K and
the block-table width), so a serving run typically captures 3–6 graphs: the general one,
single-sequence prefill (S = K = 1), one-token decode (T = S = K = 1), a prefill chunk that
samples nothing (K = 0), and batches whose sequences all fit in one block (width 1). The test
sequence prefill → packed prefill → decodes gives exactly 3. _RECOMPILE_LIMIT leaves ample
room above that; hitting it means shapes are being specialised that should not be.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch._dynamo.exc import BackendCompilerFailed, Unsupported

from compiled_engine.distributed.layout import TensorParallelLayout
from compiled_engine.errors import UnsupportedModelError
from compiled_engine.graphs.attention_interface import (
    ATTENTION_NAME,
    register_paged_attention,
    step_attention_kwargs,
)
from compiled_engine.graphs.pass_manager import PassManager, PassReport
from compiled_engine.graphs.pass_pipeline import default_pass_manager
from compiled_engine.graphs.passes.freeze_parameters import (
    frozen_callable,
    kept_example_inputs,
    kept_input_indices,
)
from compiled_engine.graphs.passes.fuse_linears import FusedWeightCache
from compiled_engine.graphs.step_inputs import StepInputs, anchor_step_metadata
from compiled_engine.kernels.backends import AttentionBackend
from compiled_engine.kernels.weight_quantization import output_embeddings
from compiled_engine.records.weight_quantization import WeightQuantization

# Distinct graphs one CapturedModel may trace (see the module docstring for the usual count).
_RECOMPILE_LIMIT = 32

_step_ids = itertools.count()

GraphCompiler = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]
# What the traced step runs: (model, kv_caches, inputs, validate_only) -> the step's output rows.
ModelCall = Callable[[torch.nn.Module, list[torch.Tensor], StepInputs, bool], torch.Tensor]


def _run_model(
    model: torch.nn.Module, kv_caches: list[torch.Tensor], inputs: StepInputs, validate_only: bool = False
) -> torch.Tensor:
    output = model(
        input_ids=inputs.input_ids,
        position_ids=inputs.positions,
        use_cache=False,
        # A 1-D index tensor: the model projects only these rows onto the vocabulary.
        logits_to_keep=inputs.logits_indices,
        **step_attention_kwargs(inputs, kv_caches, validate_only),
    )
    return output.logits[0]


class CapturedModel:
    """One model's captured step: `__call__(StepInputs) -> logits [K, vocab]`.

    `graphs` holds every lowered GraphModule traced so far (one per shape specialisation) and
    `pass_log` the matching PassReports, in capture order. `pass_manager`'s capture-time passes
    run on each graph; when they freeze its weights (freeze_parameters), the graph takes fewer
    inputs than Dynamo's, and the backend adapts the call.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        pass_manager: PassManager,
        graph_compiler: GraphCompiler | None = None,
        run_model: ModelCall | None = None,
    ) -> None:
        self.model = model
        # The LM's logits by default; a pooling model's hidden states (compiled_engine/pooling/).
        self._run_model: ModelCall = run_model or _run_model
        self.kv_caches = kv_caches
        self.pass_manager = pass_manager
        self.graphs: list[fx.GraphModule] = []
        self.pass_log: list[PassReport] = []
        self._graph_compiler = graph_compiler
        for cache in kv_caches:
            # Keep the caches' layout sizes out of the symbolic shapes (the SDPA lowering compares
            # their head count with the model's k/v statically). The block count stays symbolic:
            # it is sized from free memory, and graphs (and the compile cache) must not depend on it.
            for dim in (0, 2, 3, 4):
                torch._dynamo.mark_static(cache, dim)

        def forward_step(inputs: StepInputs, kv_caches: list[torch.Tensor]) -> torch.Tensor:
            # Keeps the metadata in the graph even if the model never reads it (route b).
            anchor_step_metadata(inputs, kv_caches)
            return self._run_model(model, kv_caches, inputs, False)

        self._compiled = torch.compile(
            _with_own_code_object(forward_step), backend=self._backend, fullgraph=True, dynamic=True
        )

    def _backend(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        num_dynamo_inputs = len(example_inputs)
        report = self.pass_manager.run_capture(gm, example_inputs)
        kept = kept_input_indices(gm, num_dynamo_inputs)
        self.graphs.append(gm)
        self.pass_log.append(report)
        if self._graph_compiler is not None:
            run = self._graph_compiler(gm, kept_example_inputs(example_inputs, kept))
        else:
            run = gm.forward
        return frozen_callable(run, kept, num_dynamo_inputs)

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        # specialize_float: float attributes such as the attention scale stay Python floats
        # (the op's `scale: float`) instead of becoming graph inputs read back with .item().
        settings = torch._dynamo.config.patch(
            specialize_float=True,
            recompile_limit=_RECOMPILE_LIMIT,
            accumulated_recompile_limit=max(
                _RECOMPILE_LIMIT, torch._dynamo.config.accumulated_recompile_limit
            ),
        )
        with settings, torch.no_grad():
            try:
                return self._compiled(inputs, self.kv_caches)
            except BackendCompilerFailed as exc:
                # Our passes raise LoweringError inside the backend; surface it, not Dynamo's wrapper.
                if isinstance(exc.inner_exception, UnsupportedModelError):
                    raise exc.inner_exception from None
                raise
            except Unsupported as exc:
                error = self._attention_error(inputs)
                if error is not None:
                    raise error from exc
                raise

    def _attention_error(self, inputs: StepInputs) -> UnsupportedModelError | None:
        """Re-run the step eagerly in validate-only mode to recover our own error, if it was ours.

        An UnsupportedModelError raised by the attention function while Dynamo traces it
        reaches us only as a generic `Unsupported: Observed exception`. Eagerly, with the op
        call skipped (nothing is written to the KV cache), the same check raises the real error.
        """
        try:
            self._run_model(self.model, self.kv_caches, inputs, True)
        except UnsupportedModelError as error:
            return error
        except Exception:
            # Not one of our checks: Dynamo's own error, re-raised by the caller, says more.
            return None
        return None


def _with_own_code_object(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of `fn` with a code object of its own.

    Dynamo keeps its graph cache (and its recompile count) on the code object. Every
    CapturedModel's step closure shares one code object, so without this, each engine in a
    process would add its graphs to one shared cache: guards of every other model checked on
    each call, and the recompile limit reached after a few engines.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_step_ids)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _check_kv_caches(kv_caches: list[torch.Tensor]) -> None:
    if not isinstance(kv_caches, list) or not kv_caches:
        raise ValueError("kv_caches must be a non-empty list with one tensor per attention layer")
    for i, cache in enumerate(kv_caches):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 5 or cache.shape[0] != 2:
            shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
            raise ValueError(f"kv_caches[{i}] must be [2, num_blocks, block_size, Hkv, D], got {shape}")


def capture_model(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    graph_compiler: GraphCompiler | None = None,
    fuse_linears: bool = False,
    attention_backend: AttentionBackend | None = None,
    tensor_parallel: TensorParallelLayout | None = None,
    quantization: WeightQuantization | None = None,
    run_model: ModelCall | None = None,
) -> CapturedModel:
    """Prepare `model` for serving with paged attention; graphs are traced on first calls.

    `kv_caches`: one [2, num_blocks, block_size, Hkv, D] tensor per attention layer, the same
    list (same tensors) for every step. The model is switched to eval mode, its parameters
    stop requiring grad (Inductor would otherwise trace a backward through the custom op), and
    HF models are switched to our attention implementation. `fuse_linears`: freeze the weights
    into the graphs and fuse sibling linears (module docstring). `attention_backend`: the
    paged-attention implementation the graphs call (kernels/backends.py; default the torch op).
    `tensor_parallel`: the layout `model`'s weights were loaded in (model_loader/loader.py).
    `quantization`: weight-only quantization of every linear but the LM head
    (graphs/passes/quantize_linears.py). `run_model`: what a step computes from the model (default:
    the logits of `logits_indices`; compiled_engine/pooling/ asks for hidden-state rows).
    """
    _check_kv_caches(kv_caches)
    register_paged_attention()
    model.eval()
    model.requires_grad_(False)
    set_attn_implementation = getattr(model, "set_attn_implementation", None)
    if set_attn_implementation is not None:
        # Models that cannot switch (no AttentionInterface support) keep theirs, with a warning
        # from transformers, and go through the SDPA lowering pass instead.
        set_attn_implementation(ATTENTION_NAME)
    # One cache per captured model: its graphs share one copy of each concatenated weight.
    fused_weights = FusedWeightCache() if fuse_linears else None
    head = output_embeddings(model)
    pass_manager = default_pass_manager(
        type(model).__name__,
        len(kv_caches),
        fused_weights,
        attention_backend,
        tensor_parallel,
        quantization=quantization,
        lm_head=getattr(head, "weight", None),
        model=model,
    )
    return CapturedModel(model, kv_caches, pass_manager, graph_compiler, run_model)
