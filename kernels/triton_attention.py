"""Paged attention in Triton: the `compiled_engine::paged_attention_triton` op.

Same contract as `compiled_engine::paged_attention` (kernels/paged_attention.py) and the same
answer as kernels/reference.py, computed by four kernels:

- `_kv_cache_write_kernel`: stores this step's k/v rows at `slot_mapping`; padding rows (slot -1)
  go to offset 0 of the scratch block, exactly as the reference writes them.
- `_split_kv_decode_kernel` + `_split_kv_reduce_kernel` (flash-decoding): one query row per
  program, the context cut into partitions of `DECODE_PARTITION_SIZE` keys that run in parallel;
  each partition leaves its running max, sum of exponentials and unnormalised output, and the
  reduce kernel merges them with a log-sum-exp rescale. With a single partition the first kernel
  writes the final output itself and the reduce is skipped.
- `_extend_attention_kernel`: a tile of query rows of one sequence (prefill, chunked prefill or
  decode) against that sequence's paged history, causal and varlen.

The attention kernels look up every key position's block in the block table on its own (block =
table[position // block_size]) rather than walking whole blocks, so any block size works; the head
dim is padded to a power of two (at least 16) under masks, so any head dim up to 256 works.
Scores, softmax and accumulators are float32 whatever the input dtype.

A quantized cache (int8 or float8_e4m3fn rows with a float32 scale per token and head,
kernels/kv_quant.py) reaches the kernels as two views of its storage: the codes (fp8 as raw
bytes) and the scales. The write kernel quantizes each row with kv_quant.py's maths (round half
to even by the 1.5 * 2^23 trick, e4m3 encoded with integer ops), and the tile loader widens the
codes to float32 (fp8 through float16's bits, which needs no fp8 hardware) and applies the scale,
so the same kernels run on any GPU and under the interpreter.

The host side never reads a tensor value: grids and tile sizes come from shapes only, so the op
can be captured in a CUDA graph. Which attention kernel runs is decided from shapes too:
T == S (as many query rows as sequences, the shape of a decode batch) takes the split-KV path,
anything else the extend kernel. Both kernels locate each query row's sequence from
query_start_loc on the device, so either one is correct for any batch; the choice only picks the
faster one for the usual case (T == S with sequences of 0 and 2+ queries still comes out right).

Without a GPU the kernels run under Triton's interpreter, which must be chosen before triton is
imported: TRITON_INTERPRET=1 is read when `@triton.jit` decorates a function, and triton's own
`tl.sum`/`tl.max` are decorated when triton.language is imported. Setting it later leaves
compiled kernels that cannot run on CPU tensors; the op then refuses with an error saying so.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from compiled_engine.kernels import kv_quant
from compiled_engine.kernels.reference import _check_inputs
from compiled_engine.kernels.source_version import source_version

# Goes into the compile-cache key with the op's own version: a hash of this source and of the
# quantized cache's layout it reads (kernels/kv_quant.py).
TRITON_ATTENTION_VERSION = source_version(__name__, kv_quant.__name__)

MAX_HEAD_DIM = 256
# Keys per split-KV partition. Long enough that the reduce is cheap next to the partitions,
# short enough that a handful of decode rows still fills the GPU with programs.
DECODE_PARTITION_SIZE = 512
# KV_QUANT, the kernels' cache kind: the query's dtype, int8 codes, fp8 e4m3 codes (as bytes).
KV_PLAIN, KV_INT8, KV_FP8 = 0, 1, 2
_KV_KINDS = {torch.int8: KV_INT8, torch.float8_e4m3fn: KV_FP8}


@triton.jit
def _round_half_even(x):
    # Adding and removing 1.5 * 2^23 leaves the float32 rounded to an integer, ties to even
    # (torch.round's rule), for |x| < 2^22; the codes' range is far inside that.
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _encode_fp8(x):
    """float32 |x| <= 448 -> e4m3 bits (uint8), nearest even: kernels/cpu_attention.cpp encode_fp8."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    # Below 2^-6: subnormal steps of 2^-9 (8 steps is the first normal's code).
    subnormal = _round_half_even(magnitude * 512.0).to(tl.int32)
    # Else the mantissa rounded to 3 bits, ties to even, and the exponent rebiased from 127 to 7.
    rounded = magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)
    normal = (rounded >> 20) - 960
    return (tl.where(magnitude < 0.015625, subnormal, normal) | sign).to(tl.uint8)


@triton.jit
def _decode_codes(codes, KV_QUANT: tl.constexpr):
    """Codes as float32 values (before the row's scale)."""
    if KV_QUANT == 1:
        values = codes.to(tl.float32)
    else:
        # fp8 e4m3 -> its bits moved into a float16 (bias 7 -> 15 scales by 2^-8), widened, times 2^8.
        c = codes.to(tl.int32)
        half_bits = (((c & 0x7F) << 7) | ((c & 0x80) << 8)).to(tl.uint16)
        values = half_bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return values


@triton.jit
def _quantize_row(x, KV_QUANT: tl.constexpr):
    """One head's float32 values [BLOCK_D] (zeros past the head dim) -> codes and their scale,
    with kernels/kv_quant.py's maths."""
    # div_rn: IEEE division, as torch's and the C++ kernel's (a GPU's default may be approximate).
    amax = tl.max(tl.abs(x), axis=0)
    if KV_QUANT == 1:
        scale = tl.maximum(tl.math.div_rn(amax, 127.0), 1.1754943508222875e-38)
        scaled = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
        codes = _round_half_even(tl.minimum(tl.maximum(scaled, -127.0), 127.0)).to(tl.int8)
    else:
        scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)
        scaled = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
        codes = _encode_fp8(tl.minimum(tl.maximum(scaled, -448.0), 448.0))
    return codes, scale


@triton.jit
def _kv_cache_write_kernel(
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    kv_scale_ptr,
    slot_mapping_ptr,
    scratch_slot,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_cache_dim,
    stride_scale_kv,
    stride_scale_block,
    stride_scale_offset,
    stride_scale_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    SCALE_OFFSET: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Padding rows land in the scratch block, as in the reference: a fixed-shape write, no skip.
    slot = tl.where(slot >= 0, slot, scratch_slot)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    k = tl.load(key_ptr + token * stride_k_tok + head * stride_k_head + dims * stride_k_dim, mask=dim_mask)
    v = tl.load(value_ptr + token * stride_v_tok + head * stride_v_head + dims * stride_v_dim, mask=dim_mask)
    dest = (
        kv_cache_ptr
        + block * stride_cache_block
        + offset * stride_cache_offset
        + head * stride_cache_head
        + dims * stride_cache_dim
    )
    if KV_QUANT == 0:
        tl.store(dest, k.to(kv_cache_ptr.dtype.element_ty), mask=dim_mask)
        tl.store(dest + stride_cache_kv, v.to(kv_cache_ptr.dtype.element_ty), mask=dim_mask)
    else:
        k_codes, k_scale = _quantize_row(tl.where(dim_mask, k.to(tl.float32), 0.0), KV_QUANT)
        v_codes, v_scale = _quantize_row(tl.where(dim_mask, v.to(tl.float32), 0.0), KV_QUANT)
        # Up to the scale: the padding after the head dim gets code 0, as the reference writes it.
        row_mask = dims < SCALE_OFFSET
        tl.store(dest, k_codes, mask=row_mask)
        tl.store(dest + stride_cache_kv, v_codes, mask=row_mask)
        scale_dest = (
            kv_scale_ptr
            + block * stride_scale_block
            + offset * stride_scale_offset
            + head * stride_scale_head
        )
        tl.store(scale_dest, k_scale)
        tl.store(scale_dest + stride_scale_kv, v_scale)


@triton.jit
def _load_kv_tile(
    kv_cache_ptr,
    kv_scale_ptr,
    table_row,
    keys,
    key_mask,
    head_offset,
    dim_mask,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    scale_head_offset,
    stride_scale_kv,
    stride_scale_block,
    stride_scale_offset,
    BLOCK_SIZE: tl.constexpr,
    compute_dtype: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Keys and values [BLOCK_N, BLOCK_D] at positions `keys` of one sequence and kv head, each
    position's block looked up in the block table on its own (so any block size works);
    dequantized with their rows' scales from a quantized cache."""
    blocks = tl.load(table_row + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    kv_offsets = (
        blocks[:, None] * stride_cache_block
        + (keys % BLOCK_SIZE)[:, None] * stride_cache_offset
        + head_offset[None, :]
    )
    load_mask = key_mask[:, None] & dim_mask[None, :]
    # other=0: slots past the end may hold NaN, and 0 * NaN would leak into the sums.
    k = tl.load(kv_cache_ptr + kv_offsets, mask=load_mask, other=0)
    v = tl.load(kv_cache_ptr + stride_cache_kv + kv_offsets, mask=load_mask, other=0)
    if KV_QUANT != 0:
        scale_offsets = (
            blocks * stride_scale_block + (keys % BLOCK_SIZE) * stride_scale_offset + scale_head_offset
        )
        k_scale = tl.load(kv_scale_ptr + scale_offsets, mask=key_mask, other=0.0)
        v_scale = tl.load(kv_scale_ptr + stride_scale_kv + scale_offsets, mask=key_mask, other=0.0)
        k = _decode_codes(k, KV_QUANT) * k_scale[:, None]
        v = _decode_codes(v, KV_QUANT) * v_scale[:, None]
    return k.to(compute_dtype), v.to(compute_dtype)


@triton.jit
def _tile_scores(q, k, scale, softcap, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """q·kᵀ * scale for a tile, soft-capped when asked."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    if USE_SOFTCAP:
        # softcap * tanh(x / softcap), tanh from exp: the portable math module has no tanh.
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    return scores


@triton.jit
def _online_softmax_step(scores, v, running_max, running_sum, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile of (masked) scores and its values into the running max, sum and output."""
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    rescale = tl.exp(running_max - new_max)
    probs = tl.exp(scores - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc


@triton.jit
def _split_kv_decode_kernel(
    query_ptr,
    kv_cache_ptr,
    kv_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    num_seqs,
    context_len,
    scale,
    softcap,
    sliding_window,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_cache_dim,
    stride_scale_kv,
    stride_scale_block,
    stride_scale_offset,
    stride_scale_head,
    stride_table_seq,
    stride_out_tok,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    NUM_PARTITIONS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """One query row x one kv head (its GROUP query heads at once) x one partition of the context."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)

    # The row's sequence: searchsorted(query_start_loc[1:], token, right=True), as the reference.
    seqs = tl.arange(0, BLOCK_S)
    query_ends = tl.load(query_start_loc_ptr + 1 + seqs, mask=seqs < num_seqs, other=2**30)
    seq = tl.sum((query_ends <= token).to(tl.int32), axis=0)
    row_valid = (token >= tl.load(query_start_loc_ptr)) & (seq < num_seqs)
    seq = tl.minimum(seq, num_seqs - 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # A sequence's query rows are its last tokens.
    position = seq_len - (tl.load(query_start_loc_ptr + seq + 1) - token)

    # Visible keys form one range [lo, hi): causal end, window start, this partition's bounds.
    hi = tl.where(row_valid, tl.minimum(position + 1, context_len), 0)
    lo = part * PARTITION_SIZE
    if USE_WINDOW:
        lo = tl.maximum(lo, position - sliding_window + 1)
    hi = tl.minimum(hi, (part + 1) * PARTITION_SIZE)

    heads = kv_head * GROUP + tl.arange(0, BLOCK_G)
    head_mask = tl.arange(0, BLOCK_G) < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr
        + token.to(tl.int64) * stride_q_tok
        + heads[:, None] * stride_q_head
        + dims[None, :] * stride_q_dim,
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST:  # query and cache dtypes differ: do the dots in float32
        q = q.to(tl.float32)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    head_offset = kv_head * stride_cache_head + dims * stride_cache_dim
    # -1e30, not -inf: a row that has seen no key yet must not produce exp(-inf - -inf) = NaN.
    running_max = tl.full([BLOCK_G], -1.0e30, tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < hi
        k, v = _load_kv_tile(
            kv_cache_ptr,
            kv_scale_ptr,
            table_row,
            keys,
            key_mask,
            head_offset,
            dim_mask,
            stride_cache_kv,
            stride_cache_block,
            stride_cache_offset,
            kv_head * stride_scale_head,
            stride_scale_kv,
            stride_scale_block,
            stride_scale_offset,
            BLOCK_SIZE,
            q.dtype,
            KV_QUANT,
        )
        scores = _tile_scores(q, k, scale, softcap, USE_SOFTCAP, DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        running_max, running_sum, acc = _online_softmax_step(
            scores, v, running_max, running_sum, acc, DOT_PRECISION
        )

    out_mask = head_mask[:, None] & dim_mask[None, :]
    if NUM_PARTITIONS == 1:
        # A padding row saw no key: acc is 0 and so is the result (0 / tiny).
        result = acc / tl.maximum(running_sum, 1.1754943508222875e-38)[:, None]
        out_offsets = token.to(tl.int64) * stride_out_tok + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are [T, Hq, NUM_PARTITIONS] (+ [D] for acc), contiguous. Every partition stores,
        # even an empty one (max -1e30, sum 0, acc 0), so the reduce never reads garbage.
        stats_offsets = (token.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_PARTITIONS + part
        tl.store(part_max_ptr + stats_offsets, running_max, mask=head_mask)
        tl.store(part_sum_ptr + stats_offsets, running_sum, mask=head_mask)
        tl.store(part_acc_ptr + stats_offsets[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    stride_out_tok,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_PARTITIONS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Merge one (query row, query head)'s partitions, M being the largest partition max:

    out = sum_i acc_i * exp(m_i - M) / sum_i l_i * exp(m_i - M).
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    stats_base = (token * tl.num_programs(1) + head) * NUM_PARTITIONS
    parts = tl.arange(0, BLOCK_P)
    part_max = tl.load(part_max_ptr + stats_base + parts, mask=parts < NUM_PARTITIONS, other=-1.0e30)
    part_sum = tl.load(part_sum_ptr + stats_base + parts, mask=parts < NUM_PARTITIONS, other=0.0)
    global_max = tl.max(part_max, axis=0)
    total = tl.sum(part_sum * tl.exp(part_max - global_max), axis=0)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    acc = tl.zeros([BLOCK_D], tl.float32)
    # One partition at a time: a [partitions, D] tile would not fit in registers for long contexts.
    for part in range(NUM_PARTITIONS):
        weight = tl.exp(tl.load(part_max_ptr + stats_base + part) - global_max)
        partial = tl.load(part_acc_ptr + (stats_base + part) * HEAD_DIM + dims, mask=dim_mask, other=0.0)
        acc += partial * weight
    result = acc / tl.maximum(total, 1.1754943508222875e-38)
    out_offsets = token * stride_out_tok + head * stride_out_head + dims
    tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=dim_mask)


@triton.jit
def _extend_attention_kernel(
    query_ptr,
    kv_cache_ptr,
    kv_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    num_seqs,
    context_len,
    scale,
    softcap,
    sliding_window,
    stride_q_tok,
    stride_q_head,
    stride_q_dim,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_cache_dim,
    stride_scale_kv,
    stride_scale_block,
    stride_scale_offset,
    stride_scale_head,
    stride_table_seq,
    stride_out_tok,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """BLOCK_M query rows of one sequence x one query head, over that sequence's keys (causal)."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Tiles are numbered so that sequence s owns tiles from query_start_loc[s] // BLOCK_M + s on:
    # that start grows by at least ceil(q_len / BLOCK_M) per sequence, so no two sequences share
    # a tile, and T // BLOCK_M + S tiles (a bound from shapes alone) cover every row.
    seqs = tl.arange(0, BLOCK_S)
    query_starts = tl.load(query_start_loc_ptr + seqs, mask=seqs < num_seqs, other=2**30)
    first_tiles = query_starts // BLOCK_M + seqs
    seq = tl.sum(((first_tiles <= tile) & (seqs < num_seqs)).to(tl.int32), axis=0) - 1
    seq_valid = seq >= 0
    seq = tl.maximum(seq, 0)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)

    tile_start = query_start + (tile - (query_start // BLOCK_M + seq)) * BLOCK_M
    # Tiles before the first sequence own no rows. (An end, not `& seq_valid`: the interpreter
    # mis-types a vector & scalar bool as int32, which tl.load then rejects as a mask.)
    rows_end = tl.where(seq_valid, query_end, 0)
    rows = tile_start + tl.arange(0, BLOCK_M)
    row_mask = rows < rows_end
    # A sequence's query rows are its last tokens. Tiles past the sequence's rows mask everything.
    positions = seq_len - (query_end - rows)

    # Keys any row of the tile can see: [lo, hi).
    last_position = seq_len - query_end + tl.minimum(tile_start + BLOCK_M, query_end) - 1
    hi = tl.where(tile_start < rows_end, tl.minimum(last_position + 1, context_len), 0)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, seq_len - (query_end - tile_start) - sliding_window + 1)

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr
        + rows.to(tl.int64)[:, None] * stride_q_tok
        + head * stride_q_head
        + dims[None, :] * stride_q_dim,
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST:  # query and cache dtypes differ: do the dots in float32
        q = q.to(tl.float32)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    head_offset = kv_head * stride_cache_head + dims * stride_cache_dim
    # -1e30, not -inf: a row that has seen no key yet must not produce exp(-inf - -inf) = NaN.
    running_max = tl.full([BLOCK_M], -1.0e30, tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < hi
        k, v = _load_kv_tile(
            kv_cache_ptr,
            kv_scale_ptr,
            table_row,
            keys,
            key_mask,
            head_offset,
            dim_mask,
            stride_cache_kv,
            stride_cache_block,
            stride_cache_offset,
            kv_head * stride_scale_head,
            stride_scale_kv,
            stride_scale_block,
            stride_scale_offset,
            BLOCK_SIZE,
            q.dtype,
            KV_QUANT,
        )
        scores = _tile_scores(q, k, scale, softcap, USE_SOFTCAP, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        visible = key_mask[None, :] & (keys[None, :] <= positions[:, None]) & row_mask[:, None]
        if USE_WINDOW:
            visible = visible & (keys[None, :] > positions[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        running_max, running_sum, acc = _online_softmax_step(
            scores, v, running_max, running_sum, acc, DOT_PRECISION
        )

    result = acc / tl.maximum(running_sum, 1.1754943508222875e-38)[:, None]
    out_offsets = rows.to(tl.int64)[:, None] * stride_out_tok + head * stride_out_head + dims[None, :]
    tl.store(
        out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :]
    )


def paged_attention_triton(
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
) -> torch.Tensor:
    """Write this step's k/v into `kv_cache`, then attend each query over its sequence's cache.

    Same signature, semantics and result as `paged_attention_reference`; rows past
    query_start_loc[-1] come back as zeros. No host sync: safe inside a CUDA graph.
    """
    _check_inputs(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    _check_supported(query, kv_cache)
    cache = _CacheViews.of(kv_cache, query.shape[2])
    with _on_device(query):
        _write_kv(key, value, cache, slot_mapping)
        out = query.new_zeros(query.shape)
        num_tokens, num_seqs = query.shape[0], block_tables.shape[0]
        if num_tokens == 0 or num_seqs == 0:
            return out
        # Static choice (see the module docstring): a decode-shaped batch gets the split-KV kernel.
        attend = _split_kv_decode if num_tokens == num_seqs else _extend
        attend(query, cache, block_tables, seq_lens, query_start_loc, out, scale, sliding_window, softcap)
    return out


@dataclass(frozen=True)
class _CacheViews:
    """What the kernels read and write: the cache (a quantized one's codes, fp8 as bytes) and, for
    a quantized cache, its float32 scales [2, blocks, block_size, Hkv] (views of one storage)."""

    codes: torch.Tensor  # [2, blocks, block_size, Hkv, D or the packed row]
    scales: torch.Tensor  # the scales, or the cache itself as a pointer never read
    scale_strides: tuple[int, ...]  # [kv, block, offset, head], in float32 elements
    kind: int  # KV_PLAIN, KV_INT8 or KV_FP8
    head_dim: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor, head_dim: int) -> _CacheViews:
        kind = _KV_KINDS.get(kv_cache.dtype, KV_PLAIN)
        if kind == KV_PLAIN:
            return cls(kv_cache, kv_cache, (0, 0, 0, 0), kind, head_dim)
        _, scales = kv_quant.split_rows(kv_cache, head_dim)
        codes = kv_cache.view(torch.uint8) if kind == KV_FP8 else kv_cache
        return cls(codes, scales, tuple(scales.stride()), kind, head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype


def _check_supported(query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    head_dim = query.shape[2]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"paged_attention_triton supports head dims up to {MAX_HEAD_DIM}, got {head_dim}")
    if not query.is_cuda and not KERNELS_INTERPRETED:
        raise RuntimeError(
            f"paged_attention_triton got {query.device.type} tensors: Triton kernels need a CUDA device, "
            "or TRITON_INTERPRET=1 set before triton is first imported to run them under the interpreter"
        )
    if kv_cache.device != query.device:
        raise ValueError(f"kv_cache is on {kv_cache.device} but query is on {query.device}")


def _on_device(query: torch.Tensor):
    # Triton launches on the current CUDA device; make it the one holding the tensors.
    return torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext()


def _block_d(head_dim: int) -> int:
    # tl.arange needs a power of two and tl.dot a size of at least 16.
    return max(16, triton.next_power_of_2(head_dim))


def _key_row_bytes(query: torch.Tensor, cache: _CacheViews) -> int:
    """Bytes of one padded key row as the dot sees it (float32 when query and cache dtypes differ)."""
    element_size = 4 if query.dtype != cache.dtype else query.element_size()
    return _block_d(query.shape[2]) * element_size


def _write_kv(key, value, cache: _CacheViews, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    num_blocks, block_size = cache.codes.shape[1:3]
    _kv_cache_write_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        cache.codes,
        cache.scales,
        slot_mapping,
        (num_blocks - 1) * block_size,
        *key.stride(),
        *value.stride(),
        *cache.codes.stride(),
        *cache.scale_strides,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_SIZE=block_size,
        KV_QUANT=cache.kind,
        SCALE_OFFSET=kv_quant.scale_offset(head_dim),
    )


def _shared_args(
    query, cache: _CacheViews, block_tables, scale, sliding_window, softcap
) -> tuple[tuple, dict]:
    """Runtime arguments after the pointers, and constexprs, common to both attention kernels."""
    num_seqs, table_width = block_tables.shape
    block_size, num_kv_heads = cache.codes.shape[2:4]
    head_dim = cache.head_dim
    upcast = query.dtype != cache.dtype
    runtime = (
        num_seqs,
        table_width * block_size,
        float(scale),
        float(softcap) if softcap > 0 else 1.0,
        int(sliding_window),
        *query.stride(),
        *cache.codes.stride(),
        *cache.scale_strides,
        block_tables.stride(0),
    )
    constexprs = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        GROUP=query.shape[1] // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_S=triton.next_power_of_2(num_seqs + 1),
        USE_WINDOW=sliding_window > 0,
        USE_SOFTCAP=softcap > 0,
        UPCAST=upcast,
        # float32 dots in full precision (tf32 would miss the reference by ~1e-3); None leaves the
        # backend's default for half-precision inputs, where the option does not apply.
        DOT_PRECISION="ieee" if upcast or query.dtype == torch.float32 else None,
        KV_QUANT=cache.kind,
    )
    return runtime, constexprs


def _split_kv_decode(
    query, cache: _CacheViews, block_tables, seq_lens, query_start_loc, out, scale, sliding_window, softcap
) -> None:
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = cache.codes.shape[3]
    context_len = block_tables.shape[1] * cache.codes.shape[2]
    partition_size = DECODE_PARTITION_SIZE
    num_partitions = max(1, math.ceil(context_len / partition_size))
    # Key tiles of at most 32 KiB (64 rows of fp16 x 256): fp32 at 256 needed 148 KiB of shared
    # memory at 64 rows, more than GPUs other than A100/H100 give one block.
    widest_tile = 64 if _key_row_bytes(query, cache) <= 512 else 32
    block_n = min(widest_tile, partition_size, max(16, triton.next_power_of_2(context_len)))
    runtime, constexprs = _shared_args(query, cache, block_tables, scale, sliding_window, softcap)
    group = constexprs["GROUP"]

    if num_partitions == 1:
        # The decode kernel writes `out` itself; these pointers are never touched.
        part_max = part_sum = part_acc = out
    else:
        part_max = torch.empty(
            (num_tokens, num_q_heads, num_partitions), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(
            (num_tokens, num_q_heads, num_partitions, head_dim), dtype=torch.float32, device=query.device
        )
    _split_kv_decode_kernel[(num_tokens, num_kv_heads, num_partitions)](
        query,
        cache.codes,
        cache.scales,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        part_max,
        part_sum,
        part_acc,
        *runtime,
        out.stride(0),
        out.stride(1),
        **constexprs,
        # Pad the group to 16 rows: tl.dot needs at least 16 on each side.
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        NUM_PARTITIONS=num_partitions,
    )
    if num_partitions > 1:
        _split_kv_reduce_kernel[(num_tokens, num_q_heads)](
            out,
            part_max,
            part_sum,
            part_acc,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=constexprs["BLOCK_D"],
            NUM_PARTITIONS=num_partitions,
            BLOCK_P=triton.next_power_of_2(num_partitions),
        )


def _extend(
    query, cache: _CacheViews, block_tables, seq_lens, query_start_loc, out, scale, sliding_window, softcap
) -> None:
    num_tokens, num_q_heads, _ = query.shape
    num_seqs = block_tables.shape[0]
    runtime, constexprs = _shared_args(query, cache, block_tables, scale, sliding_window, softcap)
    # Tiles no taller than the batch; smaller tiles for big heads keep the accumulator in registers
    # and the pipelined key/value tiles within ~100 KiB of shared memory (checked for sm_90 builds).
    block_d = constexprs["BLOCK_D"]
    block_m = min(32 if block_d > 128 else 64, max(16, triton.next_power_of_2(num_tokens)))
    block_n = 64 if block_d <= 64 else 32
    if _key_row_bytes(query, cache) > 512:
        block_n = 16
    num_tiles = num_tokens // block_m + num_seqs
    _extend_attention_kernel[(num_tiles, num_q_heads)](
        query,
        cache.codes,
        cache.scales,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        *runtime,
        out.stride(0),
        out.stride(1),
        **constexprs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )


# Whether the kernels above were built for the interpreter (see the module docstring).
KERNELS_INTERPRETED = isinstance(_extend_attention_kernel, InterpretedFunction)


@torch.library.custom_op("compiled_engine::paged_attention_triton", mutates_args=("kv_cache",))
def _paged_attention_triton_op(
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
) -> torch.Tensor:
    return paged_attention_triton(
        query,
        key,
        value,
        kv_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        softcap,
    )


@_paged_attention_triton_op.register_fake
def _paged_attention_triton_fake(
    query,
    key,
    value,
    kv_cache,
    slot_mapping,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    sliding_window=-1,
    softcap=0.0,
):
    # A fresh contiguous tensor, as the torch op's fake: Inductor fails at run time with empty_like of a view.
    return query.new_empty(query.shape)
