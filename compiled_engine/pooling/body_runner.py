"""Run a pooling model's body on packed prefill-only steps through the captured graph.

The body (`Qwen3Model`, ...) is captured exactly as a generation model is (graphs/capture.py:
traced by Dynamo, every attention the paged-attention op), with `run_model` asking for its last
hidden states at the rows the pooler reads instead of logits. Before each graph runs (or is
compiled), two pooling-only rewrites: every attention call becomes `prefill_attention`, flash
SDPA per sequence over the step's own keys and values with no cache
(prefill_attention_pass.py), and with last-token or CLS pooling the last layer's tail runs only at
the pooled rows (pooled_rows_pass.py). A pooling request owns no KV blocks; the runner still keeps
one small scratch cache, just big enough for one step at the token budget, for the graph's inputs
and for any layer the first rewrite leaves on the paged op (a sliding window or soft-capping),
and lays every step's inputs out from block 0 again (nothing outlives the step).

Encoder bodies (BERT, RoBERTa, XLM-R) run the same way: their attention layers are not causal, and
the step tells the attention function so (`ce_bidirectional`), which calls the op with
`causal=False` (every token sees its whole input). Their absolute positions start at 0, or for
RoBERTa-style embeddings (which number positions from `padding_idx + 1`) at that offset. Token type
ids are left to the model: all zeros, one segment per input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from compiled_engine.graphs.attention_interface import BIDIRECTIONAL_KWARG, step_attention_kwargs
from compiled_engine.graphs.capture import CapturedModel, GraphCompiler, capture_model
from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.kernels.backends import AttentionBackend
from compiled_engine.model_loader.model_config import ModelConfig
from compiled_engine.pooling.pooled_rows_pass import select_pooled_rows
from compiled_engine.pooling.pooler import pool_rows, pooled_row_indices
from compiled_engine.pooling.prefill_attention_pass import use_prefill_attention
from compiled_engine.worker.kv_cache import allocate_kv_caches


def _hidden_rows(
    model: torch.nn.Module, kv_caches: list[torch.Tensor], inputs: StepInputs, validate_only: bool
) -> torch.Tensor:
    output = model(
        input_ids=inputs.input_ids,
        position_ids=inputs.positions,
        use_cache=False,
        **step_attention_kwargs(inputs, kv_caches, validate_only),
        **{BIDIRECTIONAL_KWARG: True},
    )
    # Only the rows the pooler reads leave the graph (`logits_indices` names them here).
    return output.last_hidden_state[0].index_select(0, inputs.logits_indices)


def is_bidirectional(model: torch.nn.Module) -> bool:
    """Whether the body's attention layers are encoder layers (transformers marks them is_causal=False)."""
    return any(getattr(module, "is_causal", True) is False for module in model.modules())


def first_position(model: torch.nn.Module) -> int:
    """The position id of a sequence's first token: `padding_idx + 1` for RoBERTa-style embeddings
    (they derive positions from the ids, skipping the padding index), else 0."""
    embeddings = getattr(model, "embeddings", None)
    if embeddings is not None and hasattr(embeddings, "create_position_ids_from_input_ids"):
        return int(embeddings.padding_idx) + 1
    return 0


# Poolings that read one row per sequence: the last layer's tail runs at those rows only.
_ONE_ROW_POOLING = ("LAST", "CLS")


def _graph_compiler(compiled: bool, pooling_type: str) -> GraphCompiler:
    """What runs each captured graph: its attention rewritten to `prefill_attention` (and, for
    last-token and CLS pooling, its last layer's tail narrowed to the pooled rows), then
    Inductor-compiled (or, eager, the rewritten graph itself)."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        use_prefill_attention(gm)
        if pooling_type in _ONE_ROW_POOLING:
            select_pooled_rows(gm)
        if not compiled:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        # compile_fx is typed as returning any of Inductor's outputs; given a graph it compiles it.
        return cast("Callable[..., Any]", compile_fx(gm, list(example_inputs)))

    return compile_graph


class BodyRunner:
    """`run(token_lists) -> [S, H]` float32 pooled vectors, one step (the caller packs steps)."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        *,
        pooling_type: str,
        token_budget: int,
        max_num_seqs: int,
        block_size: int,
        device: torch.device,
        attention_backend: AttentionBackend,
        compiled: bool,
    ) -> None:
        self.pooling_type = pooling_type
        self.block_size = block_size
        self.device = device
        self.first_position = first_position(model)
        # A step's sequences each round up to whole blocks: at most one partial block each.
        num_blocks = math.ceil(token_budget / block_size) + max_num_seqs
        self.kv_caches = allocate_kv_caches(
            model_config.num_layers,
            num_blocks,
            block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            model_config.dtype,
            device,
        )
        self.captured: CapturedModel = capture_model(
            model,
            self.kv_caches,
            graph_compiler=_graph_compiler(compiled, pooling_type),
            fuse_linears=compiled,
            attention_backend=attention_backend,
            run_model=_hidden_rows,
        )

    def step_inputs(self, token_lists: Sequence[Sequence[int]]) -> StepInputs:
        """One varlen step: the inputs back to back, each on its own run of fresh blocks."""
        lengths = [len(tokens) for tokens in token_lists]
        bs = self.block_size
        blocks_per_seq = [math.ceil(n / bs) for n in lengths]
        first_block = [0, *torch.tensor(blocks_per_seq).cumsum(0).tolist()[:-1]]
        block_tables = torch.zeros(len(lengths), max(blocks_per_seq), dtype=torch.int32)
        slots, positions = [], []
        for s, (n, start, width) in enumerate(zip(lengths, first_block, blocks_per_seq, strict=True)):
            block_tables[s, :width] = torch.arange(start, start + width, dtype=torch.int32)
            slots.append(torch.arange(start * bs, start * bs + n, dtype=torch.int64))
            positions.append(torch.arange(n, dtype=torch.int64) + self.first_position)
        query_start_loc = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        query_start_loc[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        ids = [t for tokens in token_lists for t in tokens]
        to = self.device
        return StepInputs(
            input_ids=torch.tensor([ids], dtype=torch.int64).to(to),
            positions=torch.cat(positions)[None].to(to),
            slot_mapping=torch.cat(slots).to(to),
            block_tables=block_tables.to(to),
            seq_lens=torch.tensor(lengths, dtype=torch.int32).to(to),
            query_start_loc=query_start_loc.to(to),
            logits_indices=pooled_row_indices(self.pooling_type, lengths).to(to),
        )

    def run(self, token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        rows = self.captured(self.step_inputs(token_lists))
        return pool_rows(rows, self.pooling_type, [len(t) for t in token_lists])
