"""What a CPU kernel's call costs around the kernel (#19, the one-request step): each custom op of
the one-token decode step called three ways, all doing the same work:

- `op`: as the compiled graphs call it, `torch.ops.compiled_engine.*`: the dispatcher and the
  op's C++ implementation (kernels/cpu_ops.cpp: checks, the output's allocation, the kernel), or
  its Python one where the C++ library did not build (`extra_info["implementation"]` says which);
- `python`: the op's Python implementation called directly (checks, allocation, ctypes; no
  dispatcher): what every call cost before the C++ implementations;
- `kernel`: the kernel alone through ctypes, its arguments built once.

    python -m pytest bench/test_op_call.py -q -p no:cacheprovider \
        --benchmark-columns=median,min,rounds --benchmark-json=OUT.json

At bench-small's shapes (bench/models.py), one decode row, bf16: `paged_attention_cpu` over a
128-token context (8 query heads, 4 KV heads of 64, blocks of 16), and `cpu_gemv` of a 512 x 512
weight (the attention output projection); and `onednn_linear`, oneDNN's packed GEMM, over the
same weight at 64 rows (its `kernel` path: `mkldnn::_linear_pointwise` on the packed weight); and
the quantized GEMVs `cpu_gemv_int8` / `cpu_gemv_int4` (group 32) of that weight quantized, at one
row (kernels/cpu_gemv_quantized.py). A bench-small step calls the attention op 6 times, and the
GEMV (one row) or oneDNN's linear (64 rows) 25 times, quantized or not; the Qwen2.5-0.5B shape
97 linears. The difference between an op's rows, times its calls, is what that way of calling
adds to every step. Each timed call runs `CALLS` times in a loop.
"""

from __future__ import annotations

import pytest
import torch

import compiled_engine.kernels  # noqa: F401  (registers the ops)
from bench.test_kv_cache_attention import QUERY_DTYPE as DTYPE
from bench.test_kv_cache_attention import decode_step
from compiled_engine.kernels import (
    cpu_attention,
    cpu_attention_build,
    cpu_gemv,
    cpu_gemv_quantized,
    cpu_ops,
    onednn_linear,
)
from compiled_engine.kernels.cpu_attention_build import compiler
from compiled_engine.kernels.weight_quantization import quantize_int4, quantize_int8

HIDDEN = 512
CONTEXT = 128
CALLS = {"full": 1000, "quick": 1000, "smoke": 2}
ROUNDS = {"full": 20, "quick": 5, "smoke": 1}

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler: the cpu kernels cannot be built")


def _loop(call, times: int) -> None:
    for _ in range(times):
        call()


def _implementation() -> str:
    return "python" if cpu_ops.use_native_ops() else "c++"


@pytest.mark.parametrize("path", ["op", "python", "kernel"])
def test_attention_call(benchmark, request, path):
    _implementation()  # the C++ implementation, where it builds
    args = decode_step(1, CONTEXT, "auto")  # bf16 KV, bench-small's attention shape
    op_out = torch.ops.compiled_engine.paged_attention_cpu(*args)
    if path == "op":

        def call():
            torch.ops.compiled_engine.paged_attention_cpu(*args)

    elif path == "python":

        def call():
            cpu_attention.paged_attention_cpu(*args)

        torch.testing.assert_close(cpu_attention.paged_attention_cpu(*args), op_out)
    else:
        prepared = cpu_attention.kernel_arguments(*args[:8])
        kernel = cpu_attention_build.load().ce_cpu_paged_attention
        scale = args[8]

        def call():
            kernel(prepared.ints, scale, 0.0)

        call()
        torch.testing.assert_close(prepared.out, op_out)  # the same work, not a cheaper one
    _time(benchmark, request, "op call: paged_attention_cpu, 1 row, 128 tokens of context", path, call)


def _linear_case(op, python_implementation, rows: int):
    """A bench-small-sized weight, an input of `rows` rows, the op's output, and the calls of the
    op and of its Python implementation (checked to give that output), by path; the C++
    implementation loaded first, where it builds."""
    _implementation()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(HIDDEN, HIDDEN, generator=gen).to(DTYPE)
    x = torch.randn(rows, HIDDEN, generator=gen).to(DTYPE)
    out = op(x, weight, None)
    torch.testing.assert_close(python_implementation(x, weight, None), out)
    calls = {"op": lambda: op(x, weight, None), "python": lambda: python_implementation(x, weight, None)}
    return weight, x, out, calls


def _time(benchmark, request, group: str, path: str, call) -> None:
    calls = CALLS[request.config._bench_sizes.profile]
    benchmark.group = group
    benchmark.extra_info.update(path=path, implementation=_implementation(), calls_per_round=calls)
    rounds = ROUNDS[request.config._bench_sizes.profile]
    benchmark.pedantic(_loop, args=(call, calls), rounds=rounds, warmup_rounds=1)


@pytest.mark.parametrize("path", ["op", "python", "kernel"])
def test_gemv_call(benchmark, request, path):
    weight, x, op_out, calls = _linear_case(torch.ops.compiled_engine.cpu_gemv.default, cpu_gemv._cpu_gemv, 1)
    call = calls.get(path)
    if call is None:
        entry = cpu_gemv.PACKED_GEMV_WEIGHTS.get(weight)
        kernel = cpu_gemv.load().ce_cpu_gemv
        out = torch.empty(1, HIDDEN, dtype=DTYPE)
        fixed = (x.data_ptr(), HIDDEN, 1, entry.packed_ptr, None, out.data_ptr(), HIDDEN, HIDDEN)
        isa, threads = cpu_gemv.gemv_isa(), torch.get_num_threads()

        def call():
            kernel(*fixed, entry.dtype_code, isa, threads)

        call()
        torch.testing.assert_close(out, op_out)
    _time(benchmark, request, f"op call: cpu_gemv, 1 row, {HIDDEN} x {HIDDEN}", path, call)


@pytest.mark.parametrize("path", ["op", "python", "kernel"])
def test_onednn_linear_call(benchmark, request, path):
    if not onednn_linear.onednn_linear_available(DTYPE):
        pytest.skip(f"oneDNN cannot run {DTYPE} here")
    op = torch.ops.compiled_engine.onednn_linear.default
    weight, x, op_out, calls = _linear_case(op, onednn_linear._onednn_linear, 64)
    call = calls.get(path)
    if call is None:
        packed = onednn_linear.pack_linear_weight(weight)

        def call():
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

        torch.testing.assert_close(call(), op_out)
    _time(benchmark, request, f"op call: onednn_linear, 64 rows, {HIDDEN} x {HIDDEN}", path, call)


@pytest.mark.parametrize("path", ["op", "python", "kernel"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_gemv_call(benchmark, request, scheme, path):
    _implementation()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(HIDDEN, HIDDEN, generator=gen).to(DTYPE)
    x = torch.randn(1, HIDDEN, generator=gen).to(DTYPE)
    ops = torch.ops.compiled_engine
    if scheme == "int8":
        q = quantize_int8(weight)
        operands: tuple = (q.qweight, q.scales)
        op, python_implementation = ops.cpu_gemv_int8.default, cpu_gemv_quantized._int8_op
    else:
        q = quantize_int4(weight, 32)
        operands = (q.qweight, q.scales, q.zeros, 32)
        op, python_implementation = ops.cpu_gemv_int4.default, cpu_gemv_quantized._int4_op
    op_out = op(x, *operands, None)
    assert torch.equal(python_implementation(x, *operands, None), op_out)
    if path == "op":

        def call():
            op(x, *operands, None)

    elif path == "python":

        def call():
            python_implementation(x, *operands, None)

    else:
        entry = cpu_gemv_quantized.PACKED_QUANTIZED_WEIGHTS.get(*operands)
        library, out = cpu_gemv_quantized.load(), torch.empty(1, HIDDEN, dtype=DTYPE)
        code, isa = cpu_gemv_quantized._DTYPE_CODES[DTYPE], cpu_gemv_quantized.gemv_path()
        threads = torch.get_num_threads()
        if scheme == "int8":
            packed, scales = entry.pointers
            fixed: tuple = (x.data_ptr(), HIDDEN, 1, packed, scales, None, out.data_ptr(), HIDDEN, HIDDEN)
            kernel, last = library.ce_cpu_gemv_int8, ()
        else:
            packed, scales, offsets, *scale_zero = entry.pointers
            fixed = (x.data_ptr(), HIDDEN, 1, packed, scales, offsets, 32, None, out.data_ptr(), HIDDEN,
                     HIDDEN)  # fmt: skip
            kernel, last = library.ce_cpu_gemv_int4, (scale_zero[0] if scale_zero else None,)

        def call():
            kernel(*fixed, code, isa, threads, *last)

        call()
        assert torch.equal(out, op_out)  # the same work, not a cheaper one
    _time(benchmark, request, f"op call: cpu_gemv_{scheme}, 1 row, {HIDDEN} x {HIDDEN}", path, call)
