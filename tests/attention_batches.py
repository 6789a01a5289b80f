"""Paged-attention op inputs for kernel tests: shuffled blocks with holes, NaN in unwritten slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One op call's inputs; `kv_cache` is the initial cache, copied for each implementation."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    num_pad_rows: int

    def args(self, kv_cache: torch.Tensor) -> tuple:
        return (
            self.query,
            self.key,
            self.value,
            kv_cache,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
        )


def fuse_qkv(batch: Batch) -> None:
    """Makes the batch's query, key and value strided views into one fused [T, (Hq + 2 Hkv) D]
    tensor, as a model's fused QKV projection hands them over (same values)."""
    tokens, kv_heads, head_dim = batch.key.shape
    fused = torch.cat([batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)], dim=1)
    q_end = batch.query.shape[1] * head_dim
    batch.query = fused[:, :q_end].view(tokens, -1, head_dim)
    batch.key = fused[:, q_end : q_end + kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    batch.value = fused[:, q_end + kv_heads * head_dim :].view(tokens, kv_heads, head_dim)


def make_attention_batch(
    spans,
    *,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    block_size=4,
    dtype=torch.float32,
    num_pad_rows=0,
    seed=0,
    device: torch.device | str = "cpu",
) -> Batch:
    """spans: (tokens cached before, tokens fed now) per sequence; (0, 0) is an empty padding row.

    Blocks are handed out shuffled with unused blocks left between them; never-written slots hold
    NaN, so a kernel that reads past a sequence's end or outside the mask shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(done + new) // block_size) for done, new in spans]
    num_usable = sum(needed) + 2 * len(spans)  # spare blocks: holes between the used ones
    free = torch.randperm(num_usable, generator=gen).tolist()
    kv_cache = torch.full((2, num_usable + 1, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    tables = torch.full((len(spans), max(needed) + 1), -1, dtype=torch.int32)  # a spare column of -1

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    slots, starts = [], [0]
    for row, ((done, new), count) in enumerate(zip(spans, needed, strict=True)):
        ids, free = free[:count], free[count:]
        tables[row, :count] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(done):
            kv_cache[:, ids[pos // block_size], pos % block_size] = randn(2, num_kv_heads, head_dim)
        slots += [ids[pos // block_size] * block_size + pos % block_size for pos in range(done, done + new)]
        starts.append(starts[-1] + new)
    num_tokens = starts[-1] + num_pad_rows
    slots += [-1] * num_pad_rows

    def on_device(t):
        return t.to(device)

    return Batch(
        query=on_device(randn(num_tokens, num_q_heads, head_dim)),
        key=on_device(randn(num_tokens, num_kv_heads, head_dim)),
        value=on_device(randn(num_tokens, num_kv_heads, head_dim)),
        kv_cache=on_device(kv_cache),
        slot_mapping=on_device(torch.tensor(slots, dtype=torch.int64)),
        block_tables=on_device(tables),
        seq_lens=on_device(torch.tensor([done + new for done, new in spans], dtype=torch.int32)),
        query_start_loc=on_device(torch.tensor(starts, dtype=torch.int32)),
        num_pad_rows=num_pad_rows,
    )


def check_op_under_torch_compile(op, device: torch.device | str = "cpu", atol: float = 1e-6) -> None:
    """`op` (a paged-attention op with the contract's signature) inside a torch.compile'd layer:
    same output as eager, and the compiled graph writes the real cache, not a functional copy."""
    torch._dynamo.reset()
    batch = make_attention_batch([(6, 4), (2, 1)], head_dim=16, num_pad_rows=2, device=device)

    def layer(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc):
        # Ordinary ops around the custom one, as in a model layer; a window and a soft cap.
        out = op(
            query * 1.0,
            key,
            value,
            kv_cache,
            slot_mapping,
            block_tables,
            seq_lens,
            query_start_loc,
            0.25,
            3,
            2.0,
        )
        return out.flatten(1) + 1.0

    eager_cache, compiled_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = layer(*batch.args(eager_cache))
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    torch.testing.assert_close(compiled(*batch.args(compiled_cache)), expected, atol=atol, rtol=atol)
    torch.testing.assert_close(compiled_cache, eager_cache, atol=0, rtol=0, equal_nan=True)


def quantized_cache(kv_cache: torch.Tensor, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """`kv_cache` (a batch's float cache, NaN in never-written slots) as a quantized cache of `dtype`
    (int8 / float8_e4m3fn, kernels/kv_quant.py): written rows quantized, and never-written rows given
    random codes and a NaN scale, so a kernel that reads one shows NaN as with the float cache."""
    from compiled_engine.kernels import kv_quant

    head_dim = kv_cache.shape[-1]
    written = torch.isfinite(kv_cache).all(-1)  # [2, blocks, block, Hkv]
    rows = kv_quant.pack_rows(torch.nan_to_num(kv_cache.float().cpu()), dtype)
    codes, scales = kv_quant.split_rows(rows, head_dim)
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, codes.shape, generator=gen, dtype=torch.int16).to(torch.uint8)
    stale = ~written.cpu()
    codes.view(torch.uint8)[stale] = noise[stale]
    scales[stale] = float("nan")
    return rows.to(kv_cache.device)
