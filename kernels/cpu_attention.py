"""`compiled_engine::paged_attention_cpu`: paged attention through a hand-written CPU kernel.

The "cpu" attention backend's op (kernels/backends.py): same arguments, result and contract as
`compiled_engine::paged_attention` (kernels/paged_attention.py). One call of
kernels/cpu_attention.cpp writes this step's keys and values into the cache (as the reference
does: padding to the scratch block), then attends: one work item per (run of a sequence's
consecutive rows, group of KV heads), walking the keys the run's rows see block by block through
its block table with an online softmax. So it reads each cached key and value once per run (a
verification step's k + 1 rows share one walk), prefetches the blocks ahead while computing this
one, and never reads a slot outside what this step wrote and the first row's window; causal,
sliding window, soft-capping, GQA; float32,
bfloat16 and float16 (maths in float32). The cache holds the query's dtype, or is quantized
(int8 or float8_e4m3fn rows with a float32 scale per token and head, kernels/kv_quant.py): the
kernel then quantizes what it writes and dequantizes what it reads, with the torch maths'
rounding, so its cache matches the reference's code for code.

The library is built at first use (kernels/cpu_attention_build.py); `cpu_attention_problem()`
says why it cannot run here. Opaque to Inductor, which calls it as an extern kernel from the
compiled graphs; the in-place write is declared in the schema (`Tensor(a!)`), as for
kv_cache_write, so functionalisation keeps the cache in place.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from compiled_engine.kernels import cpu_attention_build, kv_quant
from compiled_engine.kernels.cpu_attention_build import CpuKernelBuildError
from compiled_engine.kernels.reference import _check_inputs
from compiled_engine.kernels.source_version import files_version, module_file

# Goes into compile-cache keys: a hash of the op's Python side, its build and the C++ source with
# the headers it includes (the numerics live there).
CPU_ATTENTION_VERSION = files_version(
    module_file(__name__),
    module_file(cpu_attention_build.__name__),
    module_file(kv_quant.__name__),
    cpu_attention_build.SOURCE,
    *cpu_attention_build.local_headers(cpu_attention_build.SOURCE),
    cpu_attention_build.SOURCE.with_name("cpu_ops.cpp"),
)

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The cache's kind as the kernel takes it: its rows hold the query's dtype, or int8 / fp8 codes.
_KV_KINDS = {torch.int8: 1, torch.float8_e4m3fn: 2}
_INDEX_DTYPES = (torch.int32, torch.int64)
# The kernel's integer arguments, in the order kernels/cpu_attention.cpp lists them.
_ARGS = ctypes.c_int64 * 37


def cpu_attention_problem(device: torch.device | str) -> str | None:
    """Why the CPU kernel cannot run on `device` here, or None if it can (building it if needed)."""
    device = torch.device(device)
    if device.type != "cpu":
        return f'attention_backend="cpu" runs on the CPU, not on {device.type}'
    try:
        cpu_attention_build.load()
    except CpuKernelBuildError as exc:
        return f'attention_backend="cpu" needs its kernel built: {exc}'
    from compiled_engine.kernels.cpu_ops import use_native_ops  # it imports this module

    use_native_ops()  # the op's C++ implementation where it builds (kernels/cpu_ops.py)
    return None


def _as_index(t: torch.Tensor) -> torch.Tensor:
    # The kernel reads int32 or int64 with a unit stride on the last dimension.
    t = t if t.dtype in _INDEX_DTYPES else t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def _as_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # [T, H, D] with unit stride on D, in the cache's dtype (any row and head strides).
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def paged_attention_cpu(
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
    if query.device.type != "cpu" or kv_cache.device.type != "cpu":
        # Registered as CompositeExplicitAutograd (for every device key): the kernel reads host memory.
        raise ValueError(f"paged_attention_cpu runs on CPU tensors, got {query.device} and {kv_cache.device}")
    call = kernel_arguments(
        query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, sliding_window
    )
    code = cpu_attention_build.load().ce_cpu_paged_attention(call.ints, scale, softcap)
    if code == 3:
        raise IndexError(f"slot_mapping holds a slot past the cache's {call.num_slots} slots")
    if code != 0:
        raise RuntimeError(f"paged_attention_cpu: the kernel rejected its arguments (code {code})")
    return call.out


class KernelCall(NamedTuple):
    """One kernel call's integer arguments, the output they point at, and every tensor they point
    into that the caller's arguments may not hold (converted copies): keep it until the call ends."""

    ints: ctypes.Array
    out: torch.Tensor
    num_slots: int
    tensors: tuple[torch.Tensor, ...]


def kernel_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sliding_window: int = -1,
) -> KernelCall:
    """The op's checks and conversions, and the kernel's arguments
    (`ce_cpu_paged_attention(call.ints, scale, softcap)` fills `call.out`); separate so that
    bench/test_op_call.py can time the kernel's call alone."""
    _check_inputs(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc)
    dtype = query.dtype
    kv_kind = _KV_KINDS.get(kv_cache.dtype, 0)
    if dtype not in _DTYPE_CODES or (kv_kind == 0 and kv_cache.dtype != dtype):
        raise ValueError(
            f"paged_attention_cpu needs query and kv_cache of one dtype out of float32, bfloat16 and "
            f"float16 (or a quantized int8 / float8_e4m3fn cache), got {query.dtype} and {kv_cache.dtype}"
        )
    if block_tables.shape[0] == 0:
        raise ValueError("paged_attention_cpu needs at least one sequence (block_tables is [0, W])")
    if kv_cache.stride(-1) != 1:
        raise ValueError("paged_attention_cpu needs kv_cache's last dimension contiguous")
    query, key, value = (_as_rows(t, dtype) for t in (query, key, value))
    slot_mapping, block_tables, seq_lens, query_start_loc = map(
        _as_index, (slot_mapping, block_tables, seq_lens, query_start_loc)
    )
    num_tokens, num_q_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=dtype)
    cache_stride = kv_cache.stride()
    ints = _ARGS(
        query.data_ptr(), query.stride(0), query.stride(1),
        key.data_ptr(), key.stride(0), key.stride(1),
        value.data_ptr(), value.stride(0), value.stride(1),
        kv_cache.data_ptr(), kv_cache.data_ptr() + cache_stride[0] * kv_cache.element_size(),
        cache_stride[1], cache_stride[2], cache_stride[3],
        slot_mapping.data_ptr(), slot_mapping.dtype == torch.int64,
        block_tables.data_ptr(), block_tables.stride(0), block_tables.dtype == torch.int64,
        seq_lens.data_ptr(), seq_lens.dtype == torch.int64,
        query_start_loc.data_ptr(), query_start_loc.dtype == torch.int64,
        out.data_ptr(),
        num_tokens, block_tables.shape[0], block_tables.shape[1], num_blocks,
        block_size, num_q_heads, num_kv_heads, head_dim,
        sliding_window, _DTYPE_CODES[dtype], torch.get_num_threads(),
        kv_kind, kv_quant.scale_offset(head_dim),
    )  # fmt: skip
    tensors = (query, key, value, slot_mapping, block_tables, seq_lens, query_start_loc)
    return KernelCall(ints, out, num_blocks * block_size, tensors)


def _fake(
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
    return torch.empty_like(query, memory_format=torch.contiguous_format)


# The low-level API, not custom_op: the call runs once per layer per step, and custom_op's Python
# wrapper around a mutating op costs measurable time next to a kernel this short (as for
# kv_cache_write). `(a!)` declares the in-place write for functionalisation and Inductor. The
# Python implementation is CompositeExplicitAutograd: kernels/cpu_ops.cpp's CPU kernel, once
# loaded (kernels/cpu_ops.py), takes precedence over it.
_LIBRARY = torch.library.Library("compiled_engine", "FRAGMENT")
_LIBRARY.define(
    "paged_attention_cpu(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window=-1, "
    "float softcap=0.0) -> Tensor"
)
_LIBRARY.impl("paged_attention_cpu", paged_attention_cpu, "CompositeExplicitAutograd")
torch.library.register_fake("compiled_engine::paged_attention_cpu", _fake, lib=_LIBRARY)
