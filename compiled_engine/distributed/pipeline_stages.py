"""Pipeline parallelism: which decoder layers each stage owns, and each stage's slice of the model.

`pipeline_parallel_size=P` splits the decoder layers into P contiguous runs, one per stage; a
stage has `tensor_parallel_size` ranks (global rank = stage * TP + TP rank; rank 0, the engine's
own process, is stage 0's TP rank 0). The loader reads only the tensors the stage holds
(`PipelineStage.holds_tensor`: its layers, and the embedding / final norm / LM head where it has
them); the rest stay on meta. `slice_for_stage` then turns the loaded HF model into the stage's
model, in place:

- the layer list keeps the stage's layers only, each attention's `layer_idx` renumbered from 0
  (the stage's KV cache holds its own layers only; block ids are the same on every stage, as the
  scheduler on rank 0 hands them out once);
- the first stage keeps the embedding, the last the final norm and the LM head; elsewhere they
  become `nn.Identity` (no weights);
- the model's `forward` becomes the stage's: the first stage embeds `input_ids`, the others
  receive the previous stage's hidden states; a non-last stage hands its hidden states on, the
  last computes the logits and sends them back to the first stage (kernels/pipeline_transfer.py).

The step graph is then captured from that model exactly as today (graphs/capture.py: same call,
same `StepInputs`), so every stage compiles its own graphs per bucket, and the hand-offs are
opaque ops inside them, as tensor parallelism's collectives are.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

import compiled_engine.kernels.pipeline_transfer  # noqa: F401  (registers the hand-off ops)
from compiled_engine.distributed.layout import COMMUNICATING_STYLES
from compiled_engine.errors import UnsupportedModelError
from compiled_engine.kernels import collectives

if TYPE_CHECKING:  # model_loader imports distributed (the TP layout): no import back at run time
    from compiled_engine.model_loader.loader import LoadedModel

# Config attributes whose model applies more than `lm_head` to the last hidden states (soft-capping,
# scaling): the stage forward below does not, so such models are refused.
_UNSERVED_HEAD_ATTRIBUTES = ("final_logit_softcapping", "logit_scale", "logits_scaling")

# Marks a sliced model with its stage (read by the compile cache's manifest: graphs/step_graph.py).
STAGE_ATTRIBUTE = "_compiled_engine_pipeline_stage"

# Model tensor names by the module `slice_for_stage` keeps or drops (a causal LM's `model` body
# with `layers`, `embed_tokens`, `norm`, and its `lm_head`).
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")
_FIRST_STAGE_PREFIXES = ("model.embed_tokens.",)
_LAST_STAGE_PREFIXES = ("model.norm.", "lm_head.")


@dataclass(frozen=True)
class PipelineStage:
    """Stage `index` of `num_stages`: decoder layers [first_layer, end_layer), TP rank `tp_rank`
    of `tp_size` ranks."""

    index: int
    num_stages: int
    first_layer: int
    end_layer: int
    tp_rank: int
    tp_size: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def rank(self) -> int:
        return self.index * self.tp_size + self.tp_rank

    @property
    def previous_rank(self) -> int:
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def first_stage_rank(self) -> int:
        return self.tp_rank

    @property
    def last_stage_rank(self) -> int:
        return (self.num_stages - 1) * self.tp_size + self.tp_rank

    def holds_tensor(self, name: str) -> bool:
        """Whether this stage's model keeps model tensor `name` (the loader reads no other):
        its own decoder layers', the embedding's on the first stage, the final norm's and the
        LM head's on the last, and any other (rotary tables and the like) everywhere."""
        layer = _LAYER_TENSOR.match(name)
        if layer is not None:
            return self.first_layer <= int(layer.group(1)) < self.end_layer
        if name.startswith(_FIRST_STAGE_PREFIXES):
            return self.is_first
        if name.startswith(_LAST_STAGE_PREFIXES):
            return self.is_last
        return True

    @property
    def label(self) -> str:
        """For the compile cache: the stage, its layers and its peers shape its graphs."""
        return f"{self.index}/{self.num_stages} layers {self.first_layer}-{self.end_layer} tp {self.tp_size}"


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[first, end) of each stage's decoder layers: contiguous, as even as they go, the earlier
    stages taking one more where they do not divide (the last stage also runs the LM head)."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive int, got {num_stages!r}")
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={num_stages} is more than the model's {num_layers} decoder "
            "layers: every stage needs at least one"
        )
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def stage_of_rank(rank: int, num_layers: int, num_stages: int, tp_size: int) -> PipelineStage:
    first, end = split_layers(num_layers, num_stages)[rank // tp_size]
    return PipelineStage(rank // tp_size, num_stages, first, end, rank % tp_size, tp_size)


def join_stage_groups(stage: PipelineStage) -> None:
    """Every rank creates every stage's tensor-parallel group (torch.distributed wants all ranks
    in each new_group call); the graphs' collectives then run on this rank's stage group."""
    if stage.tp_size == 1:
        return
    mine = None
    for index in range(stage.num_stages):
        ranks = list(range(index * stage.tp_size, (index + 1) * stage.tp_size))
        group = dist.new_group(ranks)
        if index == stage.index:
            mine = group
    collectives.use_tensor_parallel_group(mine)


def leave_stage_groups() -> None:
    collectives.use_tensor_parallel_group(None)


def pipeline_stage_of(model: nn.Module) -> PipelineStage | None:
    return getattr(model, STAGE_ATTRIBUTE, None)


def slice_for_stage(loaded: LoadedModel, stage: PipelineStage) -> LoadedModel:
    """The stage's model (the loaded one, changed in place) and its model config and TP layout."""
    model = loaded.model
    name = type(model).__name__
    body: Any = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if body is None or not isinstance(layers, nn.ModuleList) or not hasattr(model, "lm_head"):
        raise UnsupportedModelError(
            f"{name} has no `model.layers` list and `lm_head`, so it cannot be split into pipeline stages"
        )
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for attribute in _UNSERVED_HEAD_ATTRIBUTES:
        if getattr(text_config, attribute, None) not in (None, 1, 1.0):
            raise UnsupportedModelError(
                f"{name} sets {attribute}, which pipeline stages do not apply yet; "
                "run it with pipeline_parallel_size=1"
            )
    owned = list(layers)[stage.first_layer : stage.end_layer]
    for local, layer in enumerate(owned):
        attention = getattr(layer, "self_attn", None)
        if attention is None or not hasattr(attention, "layer_idx"):
            raise UnsupportedModelError(f"{name}'s decoder layers have no self_attn.layer_idx")
        attention.layer_idx = local  # this stage's KV caches hold its layers only
    body.layers = nn.ModuleList(owned)
    if not stage.is_first:
        body.embed_tokens = nn.Identity()
    if not stage.is_last:
        body.norm = nn.Identity()
        model.lm_head = nn.Identity()
    # What the loader left unread (on meta) must be exactly what the stage dropped.
    unread = [key for key, tensor in model.state_dict().items() if tensor.is_meta]
    if unread:
        raise UnsupportedModelError(
            f"{name}'s pipeline stage {stage.index} still needs tensor(s) {unread[:5]} that its "
            "loader did not read"
        )
    setattr(model, STAGE_ATTRIBUTE, stage)
    # The stage's forward on a subclass of the model's own class (same name: the architecture the
    # compile cache and the passes read): an instance-level `forward` would change the module
    # paths Dynamo records (`forward.__self__.model...`), which the tensor-parallel pass matches.
    stage_class = type(
        type(model).__name__,
        (type(model),),
        {
            "forward": _stage_forward_for(
                stage, int(text_config.hidden_size), int(text_config.vocab_size), loaded.model_config.dtype
            ),
            "__module__": type(model).__module__,
        },
    )
    model.__class__ = stage_class
    model_config = dataclasses.replace(
        loaded.model_config,
        num_layers=len(owned),
        sliding_windows=loaded.model_config.sliding_windows[stage.first_layer : stage.end_layer],
    )
    layout = loaded.tensor_parallel
    if layout is not None:
        # The collectives the TP pass must find: only those of the modules this stage still has.
        found = tuple(
            (path, style)
            for path, module in model.named_modules()
            if not isinstance(module, nn.Identity) and (style := layout.style(path)) in COMMUNICATING_STYLES
        )
        layout = dataclasses.replace(layout, communicating_modules=found)
    return dataclasses.replace(loaded, model_config=model_config, tensor_parallel=layout)


def _stage_forward_for(stage: PipelineStage, hidden_size: int, vocab_size: int, dtype: torch.dtype) -> Any:
    """The stage's `forward`, called as graphs/capture.py calls a causal LM's."""

    def stage_forward(
        self: Any,  # the model (a transformers causal LM: `model` body, `lm_head`)
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if stage.is_first:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        else:
            received = torch.ops.compiled_engine.pp_recv_hidden(
                input_ids, hidden_size, dtype, stage.previous_rank
            )
            out = self.model(inputs_embeds=received, position_ids=position_ids, use_cache=False, **kwargs)
        hidden = out.last_hidden_state
        rows = _rows(logits_to_keep, hidden.shape[1], hidden.device)
        if stage.is_last:
            logits = self.lm_head(hidden[:, rows, :])
            if not stage.is_first:
                logits = torch.ops.compiled_engine.pp_send_logits(logits, stage.first_stage_rank)
        else:
            logits = torch.ops.compiled_engine.pp_pass_on(
                hidden,
                rows,
                vocab_size,
                stage.next_rank,
                stage.last_stage_rank if stage.is_first else -1,
            )
        return CausalLMOutputWithPast(logits=logits)

    return stage_forward


def _rows(logits_to_keep: int | torch.Tensor, num_tokens: int, device: torch.device) -> torch.Tensor:
    """transformers' `logits_to_keep` as an index tensor (the engine passes one already)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return logits_to_keep
    first = num_tokens - logits_to_keep if logits_to_keep else 0
    return torch.arange(first, num_tokens, device=device)
