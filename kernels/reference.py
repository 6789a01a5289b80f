"""Pure-torch paged attention: the backend that runs on every device and defines the right answer.

Implements the contract in kernels/paged_attention.py. The whole batch is handled with tensor
ops — each query token gathers its own sequence's context through the block table — so prefill
chunks, decodes and full prefills mix freely in one call. Tokens are processed in fixed-size
chunks only to bound the memory of the gathered keys/values. Nothing reads a tensor value back
to the host and every shape is known from the input shapes: padding slots (-1) are redirected
to the cache's scratch block rather than dropped, so a call never synchronises on CUDA and can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from compiled_engine.kernels import kv_quant
from compiled_engine.kernels.source_version import source_version

# Goes into the compile-cache key next to the op's own version: a hash of this source and of the
# quantized cache's maths it uses.
REFERENCE_VERSION = source_version(__name__, kv_quant.__name__)

# Upper bound on the float32 keys + values gathered for one chunk of query tokens. Kept well
# under glibc's 32 MiB mmap ceiling so the chunk buffers are recycled from the heap: fresh
# mmap'd buffers cost a page fault per 4 KiB and made a 64-sequence decode ~3x slower.
_GATHER_BUDGET_BYTES = 8 * 1024 * 1024


def paged_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """Write this step's k/v into `kv_cache`, then attend each query over its sequence's cache
    (up to its own position, or with `causal=False` the whole sequence).

    Query rows outside every sequence (bucket padding after query_start_loc[-1]) return zeros.
    """
    _check_inputs(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    _write_kv(key, value, kv_cache, slot_mapping)

    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads = kv_cache.shape[1:4]
    group = num_q_heads // num_kv_heads
    device = query.device
    out = query.new_zeros(query.shape)
    if block_tables.shape[0] == 0 or num_tokens == 0:
        return out

    block_tables = block_tables.long()
    seq_lens = seq_lens.long()
    query_start_loc = query_start_loc.long()
    context_len = block_tables.shape[1] * block_size

    # Each token's sequence and absolute position. searchsorted (not repeat_interleave) maps
    # padding rows past the last sequence to S, which we mask, and needs no host-side length.
    token_idx = torch.arange(num_tokens, device=device)
    seq_idx = torch.searchsorted(query_start_loc[1:].contiguous(), token_idx, right=True)
    token_valid = (token_idx >= query_start_loc[0]) & (seq_idx < seq_lens.shape[0])
    seq_idx = seq_idx.clamp(max=seq_lens.shape[0] - 1)
    # A sequence's queries are its last q_len tokens: position = seq_len - (query_end - token).
    positions = seq_lens[seq_idx] - (query_start_loc[seq_idx + 1] - token_idx)
    # The last key position each query sees: its own, or (bidirectional) its sequence's last.
    last_visible = positions if causal else seq_lens[seq_idx] - 1

    key_positions = torch.arange(context_len, device=device)
    # Block-table entries past a sequence's length may be padding (-1 or stale ids); clamp them
    # into range so the gather is legal — the position mask discards whatever they point at.
    safe_tables = block_tables.clamp(0, num_blocks - 1)
    key_cache, value_cache = kv_cache[0], kv_cache[1]

    bytes_per_token = 2 * context_len * num_kv_heads * head_dim * 4
    chunk = max(1, _GATHER_BUDGET_BYTES // max(1, bytes_per_token))
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        size = end - start
        blocks = safe_tables[seq_idx[start:end]].flatten()  # [C * max_blocks]
        # [C * max_blocks, block_size, Hkv, D] -> [C, L, Hkv, D] (a view), float32 for the maths.
        # index_select, not advanced indexing: it copies whole blocks and is several times faster.
        k = _gather_float(key_cache, blocks, head_dim).view(size, context_len, num_kv_heads, head_dim)
        v = _gather_float(value_cache, blocks, head_dim).view(size, context_len, num_kv_heads, head_dim)
        # GQA: view q heads as [Hkv, G] so each kv head serves its group of G without repeating
        # k/v, in HF's repeat_kv order (q head h uses kv head h // G).
        q = query[start:end].float().reshape(size, num_kv_heads, group, head_dim)

        pos = positions[start:end, None]
        visible = (key_positions[None, :] <= last_visible[start:end, None]) & token_valid[start:end, None]
        if sliding_window > 0:
            visible &= key_positions[None, :] > pos - sliding_window
        # Unwritten or stale slots may hold NaN/inf; a zero weight does not cancel them (0 * NaN).
        # k needs no such care: its scores are overwritten with -inf below.
        v.masked_fill_(~visible[:, :, None, None], 0.0)

        # One batched matmul per kv head (a fixed, small loop): k[:, :, h] is a strided view
        # that bmm reads in place, where a single einsum over [C, Hkv] would first copy k/v.
        scores = torch.stack(
            [torch.bmm(q[:, h], k[:, :, h].transpose(1, 2)) for h in range(num_kv_heads)], dim=1
        )  # [C, Hkv, G, L]
        scores = scores * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))

        # Softmax by hand so a row with no visible key (padding) yields zeros instead of NaN.
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(scores - row_max)
        denom = weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        weights = weights / denom
        attended = torch.stack(
            [torch.bmm(weights[:, h], v[:, :, h]) for h in range(num_kv_heads)], dim=1
        )  # [C, Hkv, G, D]
        out[start:end] = attended.view(size, num_q_heads, head_dim).to(query.dtype)
    return out


def _gather_float(cache: torch.Tensor, blocks: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Whole blocks of one side of the cache, [n, block_size, Hkv, D] in float32 (dequantized
    from a quantized cache's packed rows: kernels/kv_quant.py)."""
    gathered = cache.index_select(0, blocks)
    if kv_quant.is_quantized(cache.dtype):
        return kv_quant.unpack_rows(gathered, head_dim)
    return gathered.float()


def _write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_blocks, block_size = kv_cache.shape[1:3]
    slots = slot_mapping.long()
    # Padding goes to the scratch block (the last one), whatever lands there is never read.
    scratch_slot = (num_blocks - 1) * block_size
    slots = torch.where(slots >= 0, slots, scratch_slot)
    rows = torch.stack((key, value))  # [2, T, Hkv, D]
    if kv_quant.is_quantized(kv_cache.dtype):
        rows = kv_quant.pack_rows(rows, kv_cache.dtype)  # [2, T, Hkv, row]: codes and scale
        # As bytes: index_copy_ and index_put_ have no float8 kernels (same element size, same bits).
        rows, kv_cache = rows.view(torch.uint8), kv_cache.view(torch.uint8)
    else:
        rows = rows.to(kv_cache.dtype)
    if kv_cache.is_contiguous():
        # One indexed copy for K and V together over the cache's slots: this runs once per layer
        # per step, and each eager op costs more dispatch than its few rows of data.
        kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:]).index_copy_(1, slots, rows)
        return
    # A strided cache: index (block, offset) on the 5-D tensor, so the write still lands in place.
    kv_cache[:, slots // block_size, slots % block_size] = rows


def _check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    # Shape checks only: reading values would force a device sync on every call.
    if query.dim() != 3:
        raise ValueError(f"query must be [T, Hq, D], got shape {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, Hkv, D], got shape {tuple(kv_cache.shape)}"
        )
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [T, Hkv, D] = {(num_tokens, num_kv_heads, head_dim)} to match query "
                f"and kv_cache, got {tuple(t.shape)}"
            )
    width = kv_quant.row_width(head_dim, kv_cache.dtype)
    if kv_cache.shape[4] != width:
        if kv_quant.is_quantized(kv_cache.dtype):
            raise ValueError(
                f"a {kv_cache.dtype} kv_cache holds packed rows of {width} bytes for head dim {head_dim} "
                f"(codes, padding, float32 scale: kernels/kv_quant.py), got {kv_cache.shape[4]}"
            )
        raise ValueError(f"kv_cache head dim {kv_cache.shape[4]} != query head dim {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if tuple(slot_mapping.shape) != (num_tokens,):
        raise ValueError(f"slot_mapping must be [T] = [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got shape {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(f"seq_lens must be [S] = [{num_seqs}], got {tuple(seq_lens.shape)}")
    if tuple(query_start_loc.shape) != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [S+1] = [{num_seqs + 1}], got {tuple(query_start_loc.shape)}"
        )
    for name, t in (
        ("slot_mapping", slot_mapping),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
