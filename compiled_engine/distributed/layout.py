"""Which slice of each weight a tensor-parallel rank holds, from the model's own TP plan.

transformers models carry a plan of module-path patterns -> style (`model._tp_plan`, built from
the config's `base_model_tp_plan` and the head's own plan). The styles served here:
- "colwise": the linear's output features are split across ranks (q/k/v, gate/up);
- "rowwise": its input features are split; each rank's output is a partial sum that the graph
  all-reduces (o_proj, down_proj); a bias is kept on rank 0 only, so it is added once;
- "embedding_rowwise": the embedding table's vocabulary rows are split; the graph masks ids
  outside the rank's range and all-reduces (exactly one rank contributes each row);
- "colwise_gather_output": the LM head's vocabulary rows are split; the graph all-gathers logits;
- "replicated_with_grad_allreduce": kept whole (Qwen3's per-head q/k norms).
Attention projections split by whole heads. With fewer KV heads than ranks, each KV head is
replicated on the ranks whose query heads use it. A vocabulary the ranks cannot split evenly
keeps the embedding and LM head whole on every rank.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import TYPE_CHECKING

from compiled_engine.errors import UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

LAYOUT_VERSION = "1"

COLWISE, ROWWISE = "colwise", "rowwise"
VOCAB_EMBEDDING, VOCAB_HEAD = "embedding_rowwise", "colwise_gather_output"
REPLICATED = "replicated_with_grad_allreduce"
SERVED_STYLES = (COLWISE, ROWWISE, VOCAB_EMBEDDING, VOCAB_HEAD, REPLICATED)
# Styles after which the graph must communicate (graphs/passes/tensor_parallel.py).
COMMUNICATING_STYLES = (ROWWISE, VOCAB_EMBEDDING, VOCAB_HEAD)


@dataclass(frozen=True)
class Shard:
    """Rows or columns [start, start + size) of dim `dim` of a full tensor."""

    dim: int
    start: int
    size: int

    def shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] = self.size
        return tuple(shape)

    def index(self, ndim: int) -> tuple[slice, ...]:
        return tuple(
            slice(self.start, self.start + self.size) if d == self.dim else slice(None) for d in range(ndim)
        )


@dataclass(frozen=True)
class TensorParallelLayout:
    rank: int
    world_size: int
    styles: tuple[tuple[str, str], ...]  # (module-path pattern, style), the model's plan
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    # Module paths per communicating style that the model has, for the graph pass to check.
    communicating_modules: tuple[tuple[str, str], ...]

    @classmethod
    def for_model(cls, model: PreTrainedModel, rank: int, world_size: int) -> TensorParallelLayout:
        """The layout of `model` (built on meta is enough) for `rank` of `world_size`."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
        name = type(model).__name__
        plan = dict(getattr(model, "_tp_plan", None) or {})
        if not plan:
            raise UnsupportedModelError(
                f"{name} has no tensor-parallel plan (its config has no base_model_tp_plan), so it "
                "cannot run with tensor_parallel_size > 1"
            )
        unknown = sorted({style for style in plan.values() if style not in SERVED_STYLES})
        if unknown:
            raise UnsupportedModelError(
                f"{name}'s tensor-parallel plan uses style(s) {unknown}; served: {list(SERVED_STYLES)}"
            )
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
        if num_heads % world_size:
            raise UnsupportedModelError(
                f"{name} has num_attention_heads={num_heads}, not divisible by "
                f"tensor_parallel_size={world_size}"
            )
        if num_kv_heads % world_size and world_size % num_kv_heads:
            raise UnsupportedModelError(
                f"{name} has num_key_value_heads={num_kv_heads}: tensor_parallel_size={world_size} "
                "must divide it or be a multiple of it"
            )
        layout = cls(
            rank=rank,
            world_size=world_size,
            styles=tuple(plan.items()),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=int(config.vocab_size),
            communicating_modules=(),
        )
        found = tuple(
            (path, style)
            for path, _ in model.named_modules()
            if (style := layout.style(path)) in COMMUNICATING_STYLES
        )
        return dataclasses.replace(layout, communicating_modules=found)

    # -- styles ----------------------------------------------------------------------------------

    @property
    def vocab_sharded(self) -> bool:
        return self.vocab_size % self.world_size == 0

    @property
    def vocab_range(self) -> tuple[int, int]:
        """(first id, count) of the vocabulary rows this rank holds."""
        size = self.vocab_size // self.world_size
        return self.rank * size, size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    def style(self, module_path: str) -> str | None:
        """The style this rank applies to the module at `module_path`; None: kept whole."""
        for pattern, style in self.styles:
            if fnmatch.fnmatchcase(module_path, pattern):
                if style in (VOCAB_EMBEDDING, VOCAB_HEAD) and not self.vocab_sharded:
                    return None
                return None if style == REPLICATED else style
        return None

    # -- weights ---------------------------------------------------------------------------------

    def shard(self, param_name: str, full_shape: tuple[int, ...]) -> Shard | None:
        """The slice of parameter `param_name` this rank loads; None: the whole tensor."""
        module_path, _, attr = param_name.rpartition(".")
        style = self.style(module_path)
        if style is None or not full_shape:
            return None
        if style in (COLWISE, VOCAB_HEAD, VOCAB_EMBEDDING):
            return self._split(module_path, 0, full_shape[0])
        if style == ROWWISE and attr != "bias":
            return self._split(module_path, 1, full_shape[1])
        return None  # a row-parallel bias: whole, and zero off rank 0 (zero_on_this_rank)

    def zero_on_this_rank(self, param_name: str) -> bool:
        """A row-parallel bias is added once, after the all-reduce sums the partial outputs."""
        module_path, _, attr = param_name.rpartition(".")
        return attr == "bias" and self.style(module_path) == ROWWISE and self.rank != 0

    def _split(self, module_path: str, dim: int, size: int) -> Shard:
        heads = self._heads(module_path, size)
        if heads is not None:
            total, unit = heads
            if total < self.world_size:  # fewer KV heads than ranks: this rank's query heads' one
                return Shard(dim, (self.rank * total // self.world_size) * unit, unit)
            per_rank = total // self.world_size
            return Shard(dim, self.rank * per_rank * unit, per_rank * unit)
        if size % self.world_size:
            raise UnsupportedModelError(
                f"{module_path} has {size} features along the split dimension, not divisible by "
                f"tensor_parallel_size={self.world_size}"
            )
        per_rank = size // self.world_size
        return Shard(dim, self.rank * per_rank, per_rank)

    def _heads(self, module_path: str, size: int) -> tuple[int, int] | None:
        """(heads, features per head) when the split dimension holds attention heads."""
        if "attn" not in module_path:
            return None
        if size == self.num_heads * self.head_dim:
            return self.num_heads, self.head_dim
        if size == self.num_kv_heads * self.head_dim:
            return self.num_kv_heads, self.head_dim
        return None
