"""What one forward step feeds the captured graph, and the marker that keeps it in the graph.

`StepInputs` is the record the model runner hands to `CapturedModel`: views of persistent
buffers the runner owns, so the same storage is used every step.

`compiled_engine::step_metadata` is an op that does nothing at run time. The captured step
calls it with the KV caches and the attention metadata. Why: Dynamo drops every graph input
that nothing in the graph reads. A model that calls SDPA directly (route (b), rewritten by
graphs/passes/lower_sdpa.py) never reads our metadata, so without this call its graph would
have no placeholders for the caches and block tables the rewritten attention needs, and no
way to get them back: the callable Dynamo builds passes only the surviving inputs.
Anchoring them in an op keeps them as placeholders and tells the pass exactly which node is
which (by argument position, not by guessing from Dynamo's placeholder names). The marker is
registered as side-effecting so no dead-code elimination removes it before the lowering pass
has read it; graphs/passes/dce.py removes it afterwards so it never reaches Inductor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.fx.node import has_side_effect


class StepInputs(NamedTuple):
    """One step's tokens, flattened into a single [1, T] row, plus paged-attention metadata."""

    input_ids: torch.Tensor  # [1, T] int64
    positions: torch.Tensor  # [1, T] int64, absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, cache slot each token's k/v is written to; -1 = padding
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32, cached tokens per sequence after this step
    query_start_loc: torch.Tensor  # [S+1] int32, sequence s owns token rows [qsl[s], qsl[s+1])
    logits_indices: torch.Tensor  # [K] int64, token rows whose logits are returned


def front_of(buffers: StepInputs, num_tokens: int, num_seqs: int, num_logits: int, width: int) -> StepInputs:
    """Views of the front of persistent `buffers` for a step of these sizes."""
    return StepInputs(
        input_ids=buffers.input_ids[:, :num_tokens],
        positions=buffers.positions[:, :num_tokens],
        slot_mapping=buffers.slot_mapping[:num_tokens],
        block_tables=buffers.block_tables[:num_seqs, :width],
        seq_lens=buffers.seq_lens[:num_seqs],
        query_start_loc=buffers.query_start_loc[: num_seqs + 1],
        logits_indices=buffers.logits_indices[:num_logits],
    )


class FrontViews:
    """Views of the front of persistent step buffers, made once per size and then reused.

    Why: a torch slice costs about a microsecond of dispatch, and a step's inputs are seven of
    them, made again wherever a step is loaded or padded. Sizes repeat (a decode step's are its
    bucket's), so few entries cover most steps; the cache is emptied when it reaches
    `max_entries`. Only metadata is cached: the views share the buffers' storage, so they read
    whatever the buffers hold. Callers must not change a view's metadata in place.
    """

    def __init__(self, buffers: StepInputs, max_entries: int = 4096) -> None:
        self.buffers = buffers
        # On the CPU, numpy views of the whole buffers, for writes cheaper than torch's.
        self.arrays: tuple[Any, ...] | None = None
        if buffers.input_ids.is_cpu:
            self.arrays = tuple(buffer.numpy() for buffer in buffers)
        self._views: dict[tuple[int, int, int, int], StepInputs] = {}
        self._max_entries = max_entries

    def __call__(self, num_tokens: int, num_seqs: int, num_logits: int, width: int) -> StepInputs:
        key = (num_tokens, num_seqs, num_logits, width)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= self._max_entries:
                self._views.clear()
            views = self._views[key] = front_of(self.buffers, num_tokens, num_seqs, num_logits, width)
        return views


@torch.library.custom_op("compiled_engine::step_metadata", mutates_args=())
def step_metadata(
    kv_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """No-op at run time; in a captured graph its arguments name the paged-attention inputs."""
    return None


@step_metadata.register_fake
def _step_metadata_fake(kv_caches, slot_mapping, block_tables, seq_lens, query_start_loc) -> None:
    return None


# A node without users and without a mutable schema is dead to fx's eliminate_dead_code; this
# marker has to survive until the lowering pass reads it (dce.py then removes it on purpose).
has_side_effect(torch.ops.compiled_engine.step_metadata.default)
has_side_effect(torch.ops.compiled_engine.step_metadata)

STEP_METADATA_TARGETS = (
    torch.ops.compiled_engine.step_metadata,
    torch.ops.compiled_engine.step_metadata.default,
)


def anchor_step_metadata(inputs: StepInputs, kv_caches: list[torch.Tensor]) -> None:
    """Call the marker op on this step's metadata (from inside the traced step function)."""
    torch.ops.compiled_engine.step_metadata(
        kv_caches, inputs.slot_mapping, inputs.block_tables, inputs.seq_lens, inputs.query_start_loc
    )
