"""Paged attention as plain torch for Inductor to compile, plus the KV-cache write as its own op.

The opaque `compiled_engine::paged_attention` op runs ~40 small eager ops per layer: on CPU that
is ~0.5 ms of dispatch at batch 1 and, at batch 64, strided per-head bmm that Inductor cannot
touch. Split in two instead:

- `torch.ops.compiled_engine.kv_cache_write` — the only side effect, a custom op that mutates the
  cache in place (same write as kernels/reference.py, so padding slots -1 land in the scratch
  block and the op never reads a value back to the host);
- `paged_attention_inline` — the read side as pure tensor maths that Dynamo traces with T tokens,
  S sequences and W block-table columns all symbolic, and that Inductor lowers to a few fused
  loops: the block-table gather becomes an indirect load inside the score and weighted-sum
  reductions, so the gathered keys/values are never materialised.

Both follow the contract in kernels/paged_attention.py; `paged_attention_inline` expects this
step's keys/values to be in the cache already (call `kv_cache_write` first). It needs S >= 1,
which every engine step has (padded buckets add empty rows, never remove them).

Run it eager only on small inputs: without Inductor every broadcast product below is a real
[T, L, Hq, D] tensor.
"""

from __future__ import annotations

import torch

from compiled_engine.kernels import kv_quant
from compiled_engine.kernels.reference import _write_kv
from compiled_engine.kernels.source_version import source_version

# Goes into every compile-cache key (Inductor's own key does not see a custom op's Python body):
# a hash of this source, the reference's KV write it reuses and the quantized cache's maths
# (kernels/source_version.py).
INLINE_ATTENTION_VERSION = source_version(
    __name__, "compiled_engine.kernels.reference", "compiled_engine.kernels.kv_quant"
)

# `materialize(x)`: a contiguous copy of x that Inductor cannot see through. Why: Inductor inlines
# a pointwise producer into each consumer, and inside the attention's reductions that means
# recomputing it per key. The query arrives as the model's rotary embedding of the q projection
# (cos/sin of position x frequency): inlined, the score loop evaluated those transcendentals for
# every (row, head, key) (seen in the generated C++ of bench-small's 64-row bucket). Copying the
# query once costs T x Hq x D; the gathered block ids ([T, W]) likewise, instead of redoing the
# table lookup and clamp per key. docs/performance.md has the step times before and after.
_LIBRARY = torch.library.Library("compiled_engine", "FRAGMENT")
_LIBRARY.define("materialize(Tensor x) -> Tensor")
_LIBRARY.impl(
    "materialize", lambda x: x.clone(memory_format=torch.contiguous_format), "CompositeExplicitAutograd"
)
torch.library.register_fake(
    "compiled_engine::materialize",
    lambda x: torch.empty_like(x, memory_format=torch.contiguous_format),
    lib=_LIBRARY,
)
materialize = torch.ops.compiled_engine.materialize.default


def _kv_cache_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's k/v [T, Hkv, D] at `slot_mapping` [T] of kv_cache [2, blocks, block, Hkv, D].

    Slots of -1 (padding) go to the cache's last block, the scratch block; values are cast to the
    cache's dtype; the write is in place even when the cache is a strided view.
    """
    _check_write_inputs(key, value, kv_cache, slot_mapping)
    _write_kv(key, value, kv_cache, slot_mapping)


# The low-level torch.library API, not `torch.library.custom_op`: this runs once per layer per
# step, and on this CPU custom_op's Python wrapper around a mutating op cost about as much again
# as this small write. The schema's `(a!)` marks the in-place write for functionalisation and
# Inductor, as mutates_args did.
_LIBRARY.define("kv_cache_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()")
_LIBRARY.impl("kv_cache_write", _kv_cache_write, "CompositeExplicitAutograd")
torch.library.register_fake(
    "compiled_engine::kv_cache_write", lambda key, value, kv_cache, slot_mapping: None, lib=_LIBRARY
)
kv_cache_write = torch.ops.compiled_engine.kv_cache_write.default


def _check_write_inputs(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # Shapes only: reading a value would sync the device on every call.
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, Hkv, D], got shape {tuple(kv_cache.shape)}"
        )
    head_dim = key.shape[-1]
    expected = (slot_mapping.shape[0], kv_cache.shape[3], head_dim)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must be [T, Hkv, D] = {expected}, got {tuple(t.shape)}")
    if kv_cache.shape[4] != kv_quant.row_width(head_dim, kv_cache.dtype):
        raise ValueError(
            f"kv_cache rows of {kv_cache.shape[4]} do not hold {kv_cache.dtype} heads of dim {head_dim} "
            f"(want {kv_quant.row_width(head_dim, kv_cache.dtype)}: kernels/kv_quant.py)"
        )
    if slot_mapping.dim() != 1 or slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise ValueError(f"slot_mapping must be a 1-D integer tensor, got {slot_mapping.dtype}")


def paged_attention_inline(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attend each query row [T, Hq, D] over its sequence's cached keys/values; returns [T, Hq, D].

    Rows past query_start_loc[-1] (bucket padding) come back as zeros. Maths in float32, result in
    query's dtype. No `.item()`, no loop or branch over tensor sizes or values: one Dynamo graph
    serves every T, S and W.
    """
    if query.dim() != 3 or kv_cache.dim() != 5:
        raise ValueError(
            f"query must be [T, Hq, D] and kv_cache [2, blocks, block, Hkv, D], got "
            f"{tuple(query.shape)} and {tuple(kv_cache.shape)}"
        )
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads = kv_cache.shape[1:4]
    quantized = kv_quant.is_quantized(kv_cache.dtype)
    if num_q_heads % num_kv_heads != 0 or kv_cache.shape[4] != kv_quant.row_width(head_dim, kv_cache.dtype):
        raise ValueError(
            f"query [T, {num_q_heads}, {head_dim}] does not fit kv heads x head dim "
            f"{num_kv_heads} x {kv_cache.shape[4]}" + (" (packed quantized rows)" if quantized else "")
        )
    group = num_q_heads // num_kv_heads
    num_seqs, width = block_tables.shape
    context_len = width * block_size
    device = query.device

    seq_lens = seq_lens.long()
    query_start_loc = query_start_loc.long()
    # Each row's sequence and absolute position, as in reference.py: searchsorted maps rows past
    # the last sequence to S (masked below) without a host-side length.
    token_idx = torch.arange(num_tokens, device=device)
    seq_idx = torch.searchsorted(query_start_loc[1:].contiguous(), token_idx, right=True)
    token_valid = (token_idx >= query_start_loc[0]) & (seq_idx < num_seqs)
    seq_idx = seq_idx.clamp(max=num_seqs - 1)
    positions = seq_lens[seq_idx] - (query_start_loc[seq_idx + 1] - token_idx)

    # Causal (which also hides slots past seq_len), window, and padding rows: [T, L], then
    # [T, 1, 1, L] to broadcast over [Hkv, G].
    key_positions = torch.arange(context_len, device=device)
    visible = (key_positions[None, :] <= positions[:, None]) & token_valid[:, None]
    if sliding_window > 0:
        visible = visible & (key_positions[None, :] > positions[:, None] - sliding_window)
    visible = visible[:, None, None, :]

    # Table entries past a sequence's end may be -1 or stale; clamped, they stay legal to read and
    # the mask discards them. Plain indexing, not index_select: both lower to the same indirect
    # load, and this keeps the [T, W] structure the view below needs.
    blocks = materialize(block_tables.long().clamp(0, num_blocks - 1)[seq_idx])  # [T, W]
    # [T, W, block, Hkv, D] -> [T, Hkv, 1, L, D]: L next to D puts the softmax reductions on the
    # innermost dimension of the scores, which Inductor then vectorises and parallelises over rows
    # (with L outermost it ran them one row at a time; ~15% slower at 64 x 512).
    keys = _gathered_float(kv_cache[0], blocks, head_dim)
    values = _gathered_float(kv_cache[1], blocks, head_dim)
    keys = keys.view(num_tokens, context_len, num_kv_heads, head_dim).permute(0, 2, 1, 3)
    values = values.view(num_tokens, context_len, num_kv_heads, head_dim).permute(0, 2, 1, 3)
    keys, values = keys[:, :, None], values[:, :, None]
    # GQA without repeating k/v: q head h = kv head h // G, HF's repeat_kv order.
    q = materialize(query).float().reshape(num_tokens, num_kv_heads, group, 1, head_dim)

    # Broadcast-multiply + sum, not matmul/einsum: an extern GEMM would force Inductor to
    # materialise the gathered keys; a reduction lets it read them straight from the cache.
    scores = (q * keys).sum(-1) * scale  # [T, Hkv, G, L]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # where, not a multiply: masked slots may hold NaN/inf, which survive 0 * x.
    scores = torch.where(visible, scores, float("-inf"))

    # Softmax by hand so a row with no visible key gives zeros, not NaN: its max is -inf, replaced
    # by 0, so every exp is 0 and the clamped denominator keeps 0 / tiny = 0.
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)  # [T, Hkv, G]
    # Values need the mask too: a zero weight times a NaN value is still NaN.
    values = torch.where(visible[..., None], values, 0.0)
    # Normalise after the weighted sum: D divisions per row instead of L.
    out = (weights[..., None] * values).sum(-2) / denom[..., None]  # [T, Hkv, G, D]
    return out.reshape(num_tokens, num_q_heads, head_dim).to(query.dtype)


def _gathered_float(cache: torch.Tensor, blocks: torch.Tensor, head_dim: int) -> torch.Tensor:
    """One side of the cache at `blocks` [T, W] as float32 [T, W, block, Hkv, D]: a quantized
    cache's codes times their rows' scales (kernels/kv_quant.py), which Inductor folds into the
    same indirect loads as the plain cache's."""
    if kv_quant.is_quantized(cache.dtype):
        return kv_quant.unpack_rows(cache[blocks], head_dim)
    return cache[blocks].float()


# The same maths as an operator a graph can name: CompositeImplicitAutograd, so tracing
# (AOTAutograd, fake tensors, functionalisation) decomposes it into the ops above, while the
# graph before Inductor holds one serialisable node instead of a reference to a Python
# function (which the compile cache cannot save). graphs/passes/inline_attention.py uses it.
_LIBRARY.define(
    "paged_attention_inline(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
    "Tensor query_start_loc, float scale, int sliding_window=-1, float softcap=0.0) -> Tensor"
)
_LIBRARY.impl("paged_attention_inline", paged_attention_inline, "CompositeImplicitAutograd")
