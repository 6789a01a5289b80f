"""Route (a): HF models reach the paged-attention op through transformers' AttentionInterface.

A model whose attention layers dispatch through `ALL_ATTENTION_FUNCTIONS` (every recent HF
decoder) calls `paged_attention_forward` instead of SDPA/eager once its attention
implementation is set to `ATTENTION_NAME`. The step metadata rides along as extra keyword
arguments of the top-level model call (`ce_*`), which transformers forwards untouched to every
attention call. A mask function returning None is registered under the same name, so the
model never builds a [T, T] mask: the op derives causality, sequence boundaries and sliding
windows from the metadata itself.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import compiled_engine.kernels  # noqa: F401  (registers torch.ops.compiled_engine.paged_attention)
from compiled_engine.errors import UnsupportedModelError
from compiled_engine.graphs.step_inputs import StepInputs

ATTENTION_NAME = "compiled_engine_paged"

KV_CACHES_KWARG = "ce_kv_caches"
SLOT_MAPPING_KWARG = "ce_slot_mapping"
BLOCK_TABLES_KWARG = "ce_block_tables"
SEQ_LENS_KWARG = "ce_seq_lens"
QUERY_START_LOC_KWARG = "ce_query_start_loc"
# Set only by CapturedModel's eager diagnosis run: validate every layer, attend to nothing.
VALIDATE_ONLY_KWARG = "ce_validate_only"
# Set only by a pooling model's step (compiled_engine/pooling/): layers that are not causal (an
# encoder body) attend over their whole sequence. Without it such a layer is refused.
BIDIRECTIONAL_KWARG = "ce_bidirectional"

_STEP_KWARGS = (
    KV_CACHES_KWARG,
    SLOT_MAPPING_KWARG,
    BLOCK_TABLES_KWARG,
    SEQ_LENS_KWARG,
    QUERY_START_LOC_KWARG,
)


def step_attention_kwargs(
    inputs: StepInputs, kv_caches: list[torch.Tensor], validate_only: bool = False
) -> dict[str, Any]:
    """The extra keyword arguments a model call needs for `paged_attention_forward`."""
    kwargs: dict[str, Any] = {
        KV_CACHES_KWARG: kv_caches,
        SLOT_MAPPING_KWARG: inputs.slot_mapping,
        BLOCK_TABLES_KWARG: inputs.block_tables,
        SEQ_LENS_KWARG: inputs.seq_lens,
        QUERY_START_LOC_KWARG: inputs.query_start_loc,
    }
    if validate_only:
        kwargs[VALIDATE_ONLY_KWARG] = True
    return kwargs


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry: query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None).

    All checks below are plain Python on shapes and attributes: under Dynamo they run once at
    trace time and leave nothing in the graph.
    """
    _check_supported(module, query, attention_mask, dropout, sliding_window, kwargs)
    # transformers' attention modules hold their layer's index as an int (checked not None above).
    layer_idx = cast(int, module.layer_idx)
    kv_caches = kwargs[KV_CACHES_KWARG]
    if not 0 <= layer_idx < len(kv_caches):
        raise UnsupportedModelError(
            f"{type(module).__name__} has layer_idx {layer_idx}, but {len(kv_caches)} KV caches were given"
        )
    if kwargs.get(VALIDATE_ONLY_KWARG, False):
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    head_dim = query.shape[-1]
    # Passed only when False, so causal graphs keep the op's call as it always was.
    bidirectional = () if getattr(module, "is_causal", True) else (False,)
    # [1, H, T, D] -> [T, H, D]: views only; the op takes strided inputs.
    out = torch.ops.compiled_engine.paged_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        kv_caches[layer_idx],
        kwargs[SLOT_MAPPING_KWARG],
        kwargs[BLOCK_TABLES_KWARG],
        kwargs[SEQ_LENS_KWARG],
        kwargs[QUERY_START_LOC_KWARG],
        head_dim**-0.5 if scaling is None else scaling,
        -1 if sliding_window is None else sliding_window,
        0.0 if softcap is None else softcap,
        *bidirectional,
    )
    # The op returns a fresh contiguous [T, Hq, D]; [1, T, Hq, D] is what HF's o_proj path expects.
    return out.unsqueeze(0), None


def _check_supported(
    module: torch.nn.Module,
    query: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    sliding_window: int | None,
    kwargs: dict[str, Any],
) -> None:
    name = type(module).__name__
    missing = [k for k in _STEP_KWARGS if k not in kwargs]
    if missing:
        raise UnsupportedModelError(
            f"{name}: attention implementation {ATTENTION_NAME!r} needs the step metadata keyword "
            f"arguments {missing}; run the model through compiled_engine.graphs.capture.CapturedModel"
        )
    if query.shape[0] != 1:
        raise UnsupportedModelError(
            f"{name}: paged attention expects all tokens flattened into batch size 1, got query "
            f"shape {tuple(query.shape)}"
        )
    if getattr(module, "layer_idx", None) is None:
        raise UnsupportedModelError(f"{name} has no layer_idx, so its KV cache cannot be chosen")
    if not getattr(module, "is_causal", True) and not kwargs.get(BIDIRECTIONAL_KWARG, False):
        raise UnsupportedModelError(
            f"{name} is bidirectional; the paged-attention op attends bidirectionally only for "
            "embedding models (runner='pooling')"
        )
    if not getattr(module, "is_causal", True) and sliding_window is not None:
        raise UnsupportedModelError(f"{name} is bidirectional with a sliding window, which the op lacks")
    if attention_mask is not None:
        raise UnsupportedModelError(
            f"{name} built its own attention mask, which the paged-attention op cannot apply "
            "(it derives causal, sequence and sliding-window masking from the step metadata)"
        )
    if dropout:
        raise UnsupportedModelError(f"{name} asks for attention dropout {dropout}; serve the model in eval()")
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(
            f"{name} uses attention sinks (s_aux), which the paged-attention op lacks"
        )


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask builder for ATTENTION_NAME: the paged op masks from its metadata, so build nothing."""
    return None


def register_paged_attention() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns the name."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
