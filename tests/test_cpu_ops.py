"""The ops' C++ implementations (kernels/cpu_ops.cpp) against their Python ones, bit for bit.

Both call the same kernels, so every result must be equal, not close: what differs is only who
checks, converts and allocates. The kernels themselves are tested against references in
tests/test_cpu_gemv.py and tests/test_cpu_attention*.py (through the dispatcher, so on whichever
implementation is registered: the C++ one wherever it builds).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from compiled_engine.kernels import (
    cpu_attention,
    cpu_attention_build,
    cpu_gemv,
    cpu_gemv_quantized,
    cpu_ops,
    onednn_linear,
)
from compiled_engine.kernels.weight_quantization import (
    QuantizedWeight,
    dequantize,
    quantize_int4,
    quantize_int8,
)
from compiled_engine.kernels.widened_linear import dense_linear
from tests.attention_batches import fuse_qkv, make_attention_batch, quantized_cache
from tests.test_cpu_attention_kv_quant import CASES

if cpu_attention_build.compiler() is None:
    pytest.skip("no C++ compiler on this machine: nothing to build", allow_module_level=True)

gemv_op = torch.ops.compiled_engine.cpu_gemv.default
# The quantized linears: the op, and its Python implementation (kernels/cpu_gemv_quantized.py).
QUANTIZED_OPS = {
    "cpu_gemv_int8": cpu_gemv_quantized.cpu_gemv_int8_linear,
    "cpu_gemm_int8": cpu_gemv_quantized.cpu_gemm_int8_linear,
    "cpu_gemv_int4": cpu_gemv_quantized.cpu_gemv_int4_linear,
    "cpu_gemm_int4": cpu_gemv_quantized.cpu_gemm_int4_linear,
}
attention_op = torch.ops.compiled_engine.paged_attention_cpu.default
onednn_op = torch.ops.compiled_engine.onednn_linear.default


@pytest.fixture(scope="module", autouse=True)
def native_ops():
    problem = cpu_ops.use_native_ops()
    assert problem is None, problem


def test_the_cpu_dispatch_key_has_the_cpp_kernels():
    # The Python implementations are CompositeExplicitAutograd; only the library adds CPU kernels.
    names = ("cpu_gemv", "paged_attention_cpu", "onednn_linear", *QUANTIZED_OPS)
    for name in names:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"compiled_engine::{name}", "CPU"), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_equals_the_python_implementation(dtype, with_bias):
    generator = torch.Generator().manual_seed(7)
    for rows, in_features, out_features in [(1, 33, 70), (3, 129, 200), (6, 515, 131)]:
        w = torch.randn(out_features, in_features, generator=generator).to(dtype)
        b = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
        wide = torch.randn(rows, in_features + 9, generator=generator).to(dtype)
        inputs = (
            wide[:, :in_features].contiguous(),
            wide[:, 4 : 4 + in_features],
            wide[:, :in_features][None],
        )
        for x in inputs:  # contiguous, a row stride past the features, a batch dimension
            assert torch.equal(gemv_op(x, w, b), cpu_gemv.cpu_gemv_linear(x, w, b)), (x.shape, x.stride())
    assert gemv_op(torch.randn(1, 0, 8).to(dtype), torch.randn(4, 8).to(dtype), None).shape == (1, 0, 4)


@pytest.mark.parametrize(
    ("x", "w", "b", "error", "message"),
    [
        (torch.randn(1, 8), torch.randn(4, 8).to(torch.bfloat16), None, ValueError, "one dtype"),
        (torch.randn(1, 8), torch.randn(4, 8), torch.randn(4).half(), ValueError, "one dtype"),
        (torch.randn(1, 9), torch.randn(4, 8), None, ValueError, "9 features"),
        (torch.randn(1, 8), torch.randn(2, 4, 8), None, ValueError, "2-D"),
        (torch.randn(1, 8).double(), torch.randn(4, 8).double(), None, ValueError, "float32, bfloat16"),
        (torch.randn(1, 8), torch.randn(4, 8), torch.randn(5), ValueError, "bias has 5 values"),
    ],
)
def test_gemv_refuses_bad_inputs(x, w, b, error, message):
    with pytest.raises(error, match=message):
        gemv_op(x, w, b)


def test_gemv_repacks_a_weight_changed_in_place_and_drops_a_dead_weights_copy():
    w = torch.randn(40, 24)
    x = torch.randn(1, 24)
    before = cpu_ops.packed_copies()
    first = gemv_op(x, w, None)
    assert cpu_ops.packed_copies() == before + 1
    with torch.no_grad():
        w.mul_(-2.0)
    assert torch.equal(gemv_op(x, w, None), -2.0 * first)
    with torch.inference_mode():
        frozen = torch.randn(40, 24)  # an inference tensor: no version counter
        assert torch.equal(gemv_op(x, frozen, None), cpu_gemv.cpu_gemv_linear(x, frozen, None))
    del w, frozen
    gc.collect()
    assert cpu_ops.packed_copies() == before


def _quantized(name, generator, dtype, out_features=131, in_features=256):
    """The operands of the quantized op `name` after x: an int8 or int4 (group 32) weight."""
    w = (torch.randn(out_features, in_features, generator=generator) + 0.5).to(dtype)
    if name.endswith("int8"):
        q = quantize_int8(w)
        return (q.qweight, q.scales)
    q = quantize_int4(w, 32)
    return (q.qweight, q.scales, q.zeros, 32)


@pytest.mark.parametrize("name", list(QUANTIZED_OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_quantized_linears_equal_the_python_implementations(name, dtype):
    op, python = getattr(torch.ops.compiled_engine, name).default, QUANTIZED_OPS[name]
    generator = torch.Generator().manual_seed(3)
    weights = _quantized(name, generator, dtype)
    bias = torch.randn(131, generator=generator).to(dtype)
    for rows in (1, 3, 20):  # the GEMV's few rows, and past the many-rows paths' first tile
        wide = torch.randn(rows, 256 + 9, generator=generator).to(dtype)
        for x in (wide[:, :256].contiguous(), wide[:, 4:260], wide[:, :256][None]):
            for b in (None, bias):
                assert torch.equal(op(x, *weights, b), python(x, *weights, b)), (rows, x.stride(), b is None)
    assert op(torch.randn(1, 0, 256).to(dtype), *weights, None).shape == (1, 0, 131)


@pytest.mark.parametrize("name", ["cpu_gemm_int8", "cpu_gemm_int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_many_rows_dequantize_once_from_the_threshold(name, dtype):
    # From DEQUANTIZE_ROWS rows both implementations run torch's GEMM over the weight dequantized
    # once (what kernels/weight_quantization.py's dequantize gives, bit for bit), widened to fp32
    # where torch has no native GEMM for the dtype (kernels/widened_linear.py's dense_linear); one
    # row fewer, the kernel. The two sides' thresholds must agree: the last row count before it
    # checks that.
    op, python = getattr(torch.ops.compiled_engine, name).default, QUANTIZED_OPS[name]
    generator = torch.Generator().manual_seed(8)
    weights = _quantized(name, generator, dtype, out_features=70)
    bias = torch.randn(70, generator=generator).to(dtype)
    q = QuantizedWeight(*weights) if name.endswith("int4") else QuantizedWeight(*weights, None, None)
    threshold = cpu_gemv_quantized.DEQUANTIZE_ROWS
    for rows in (threshold - 1, threshold, threshold + 37):
        x = torch.randn(rows, 256, generator=generator).to(dtype)
        for b in (None, bias):
            got = op(x, *weights, b)
            assert torch.equal(got, python(x, *weights, b)), (rows, b is None)
            # int4 on AVX2's int8-x path keeps the kernel at any row count
            kernel = name.endswith("int4") and cpu_gemv_quantized.gemm_int4_rounds_x_to_int8(x, 32)
            if rows >= threshold and not kernel:
                assert torch.equal(got, dense_linear(x, dequantize(q, dtype), b))
            if kernel:  # the kernel's result, x rounded to int8 (within the output's rounding)
                expected = cpu_gemv_quantized.int8_x_reference(x, q) + (0 if b is None else b.float())
                error = (got.float() - expected).abs().max() / expected.abs().max()
                assert error < 1e-2, (rows, error)
    batched = torch.randn(2, threshold // 2, 256, generator=generator).to(dtype)  # the rows of every batch
    if not (name.endswith("int4") and cpu_gemv_quantized.gemm_int4_rounds_x_to_int8(batched, 32)):
        assert torch.equal(op(batched, *weights, None), dense_linear(batched, dequantize(q, dtype), None))


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("cpu_gemv_int8", lambda x, w: (x.double(), *w), "float32, bfloat16 or float16 activations"),
        ("cpu_gemm_int4", lambda x, w: (x[:, :255], *w), "x has 255 features, the weight takes 256"),
        ("cpu_gemv_int8", lambda x, w: (x, w[0].float(), w[1]), "int8 \\[N, K\\] weight"),
        ("cpu_gemv_int8", lambda x, w: (x, w[0], w[1][:5]), "5 scales for 131 outputs"),
        ("cpu_gemv_int4", lambda x, w: (x, w[0].view(torch.int8), *w[1:]), "uint8 \\[N, K / 2\\] weight"),
        ("cpu_gemv_int4", lambda x, w: (x, *w[:3], 48), "group size 48 does not divide 256"),
        ("cpu_gemm_int4", lambda x, w: (x, w[0], w[1][:, :3], *w[2:]), "scales and zeros must be"),
    ],
)
def test_quantized_linears_refuse_bad_inputs(name, change, message):
    generator = torch.Generator().manual_seed(4)
    weights = _quantized(name, generator, torch.float32)
    x = torch.randn(2, 256, generator=generator)
    with pytest.raises(ValueError, match=message):
        getattr(torch.ops.compiled_engine, name)(*change(x, weights), None)
    with pytest.raises(ValueError, match="bias is torch.float16|bias is Half"):
        getattr(torch.ops.compiled_engine, name)(x, *weights, torch.randn(131).half())
    with pytest.raises(ValueError, match="bias has 7 values"):
        getattr(torch.ops.compiled_engine, name)(x, *weights, torch.randn(7))


def test_quantized_linears_repack_a_weight_changed_in_place_and_drop_a_dead_weights_copy():
    generator = torch.Generator().manual_seed(5)
    q8 = quantize_int8(torch.randn(70, 64, generator=generator))
    q4 = quantize_int4(torch.randn(70, 64, generator=generator), 32)
    x = torch.randn(3, 64, generator=generator)
    before = cpu_ops.packed_copies("quantized")
    first8 = torch.ops.compiled_engine.cpu_gemv_int8(x, q8.qweight, q8.scales, None)
    first4 = torch.ops.compiled_engine.cpu_gemm_int4(x, q4.qweight, q4.scales, q4.zeros, 32, None)
    assert cpu_ops.packed_copies("quantized") == before + 2
    with torch.no_grad():
        q8.scales.mul_(-2.0)  # scales count: a change to them alone repacks too
        q4.zeros.add_(1.0)
    assert torch.equal(torch.ops.compiled_engine.cpu_gemv_int8(x, q8.qweight, q8.scales, None), -2.0 * first8)
    shifted = torch.ops.compiled_engine.cpu_gemm_int4(x, q4.qweight, q4.scales, q4.zeros, 32, None)
    torch.testing.assert_close(shifted, first4 + x.sum(dim=1, keepdim=True), rtol=1e-4, atol=1e-3)
    assert cpu_ops.packed_copies("quantized") == before + 2
    del q8, q4
    gc.collect()
    assert cpu_ops.packed_copies("quantized") == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_onednn_linear_equals_the_python_implementation(dtype):
    if not onednn_linear.onednn_linear_available(dtype):
        pytest.skip(f"oneDNN cannot run {dtype} here")
    generator = torch.Generator().manual_seed(11)
    w = torch.randn(70, 33, generator=generator).to(dtype)
    b = torch.randn(70, generator=generator).to(dtype)
    for x in (torch.randn(5, 33, generator=generator).to(dtype), torch.randn(1, 64, 33).to(dtype)):
        for bias in (b, None):
            assert torch.equal(onednn_op(x, w, bias), onednn_linear._onednn_linear(x, w, bias))
    before = cpu_ops.packed_copies("onednn_linear")
    fresh = torch.randn(40, 24).to(dtype)
    x = torch.randn(3, 24).to(dtype)
    first = onednn_op(x, fresh, None)
    assert cpu_ops.packed_copies("onednn_linear") == before + 1
    with torch.no_grad():
        fresh.mul_(-2.0)
    assert torch.equal(onednn_op(x, fresh, None), -2.0 * first)  # repacked after the in-place change
    del fresh
    gc.collect()
    assert cpu_ops.packed_copies("onednn_linear") == before
    with pytest.raises(ValueError, match="2-D"):
        onednn_op(x, torch.randn(24).to(dtype), None)


def _attention_pair(batch, cache, scale, **options):
    native_cache, python_cache = cache.clone(), cache.clone()
    window, softcap = options.get("sliding_window", -1), options.get("softcap", 0.0)
    native = attention_op(*batch.args(native_cache), scale, window, softcap)
    python = cpu_attention.paged_attention_cpu(*batch.args(python_cache), scale, window, softcap)
    return native, python, native_cache, python_cache


@pytest.mark.parametrize("cache_dtype", [None, torch.int8, torch.float8_e4m3fn], ids=["plain", "int8", "fp8"])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_equals_the_python_implementation(case, cache_dtype):
    spans, batch_options, options = CASES[case]
    batch = make_attention_batch(spans, dtype=torch.bfloat16, **batch_options)
    cache = batch.kv_cache if cache_dtype is None else quantized_cache(batch.kv_cache, cache_dtype)
    native, python, native_cache, python_cache = _attention_pair(batch, cache, 0.3, **options)
    assert torch.equal(native, python)
    assert torch.equal(native_cache.view(torch.uint8), python_cache.view(torch.uint8))


def test_attention_converts_strided_and_odd_inputs_as_python_does():
    batch = make_attention_batch([(12, 4), (3, 2)], head_dim=32, block_size=4)
    fuse_qkv(batch)  # strided q, k and v
    batch.value = batch.value.half()  # another dtype: converted
    batch.block_tables = batch.block_tables.to(torch.int16)  # an index dtype the kernel widens
    batch.seq_lens = batch.seq_lens.long()
    native, python, native_cache, python_cache = _attention_pair(batch, batch.kv_cache, 0.2, sliding_window=5)
    assert torch.equal(native, python)
    assert torch.equal(native_cache.view(torch.uint8), python_cache.view(torch.uint8))  # NaN slots too


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda b: setattr(b, "query", b.query[0]), ValueError, r"query must be \[T, Hq, D\]"),
        (lambda b: setattr(b, "key", b.key[:, :1]), ValueError, "key must be"),
        (lambda b: setattr(b, "seq_lens", b.seq_lens.float()), ValueError, "seq_lens must be an integer"),
        (lambda b: setattr(b, "query_start_loc", b.query_start_loc[:-1]), ValueError, "query_start_loc must"),
        (lambda b: setattr(b, "kv_cache", b.kv_cache.half()), ValueError, "one dtype"),
        (lambda b: b.slot_mapping.__setitem__(0, 10_000), IndexError, "past the cache"),
    ],
)
def test_attention_refuses_bad_inputs_like_python(change, error, message):
    for op in (attention_op, cpu_attention.paged_attention_cpu):
        batch = make_attention_batch([(5, 3)], dtype=torch.float32)
        batch.slot_mapping = batch.slot_mapping.clone()
        change(batch)
        with pytest.raises(error, match=message):
            op(*batch.args(batch.kv_cache), 0.25)


def test_the_python_implementations_refuse_tensors_off_the_cpu():
    # They are registered for every device key; a meta tensor stands in for a GPU's here.
    meta_x, meta_w = torch.empty(1, 8, device="meta"), torch.empty(4, 8, device="meta")
    for python_implementation in (cpu_gemv._cpu_gemv, onednn_linear._onednn_linear):
        with pytest.raises(ValueError, match="runs on CPU tensors"):
            python_implementation(meta_x, meta_w, None)
    for name, python_implementation in QUANTIZED_OPS.items():
        weights = _quantized(name, torch.Generator().manual_seed(6), torch.float32, 4, 64)
        with pytest.raises(ValueError, match="runs on CPU tensors"):
            python_implementation(torch.empty(1, 64, device="meta"), *weights, None)
    batch = make_attention_batch([(5, 3)], dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match="runs on CPU tensors"):
        cpu_attention.paged_attention_cpu(*batch.args(batch.kv_cache), 0.25)


def test_a_library_that_does_not_build_leaves_the_python_implementations_serving(tmp_path):
    broken = tmp_path / "cpu_ops.cpp"
    broken.write_text("this is not C++\n")
    script = f"""
import logging, pathlib, torch, torch.nn.functional as F
logging.basicConfig(level=logging.WARNING)
from compiled_engine.kernels import cpu_ops
cpu_ops.SOURCE = pathlib.Path({str(broken)!r})
problem = cpu_ops.use_native_ops()
assert problem is not None and "failed on cpu_ops.cpp" in problem, problem
assert not torch._C._dispatch_has_kernel_for_dispatch_key("compiled_engine::cpu_gemv", "CPU")
x, w = torch.randn(2, 33), torch.randn(70, 33)
torch.testing.assert_close(torch.ops.compiled_engine.cpu_gemv(x, w, None), F.linear(x, w))
print("served")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served" in result.stdout
    assert "run their Python implementations" in result.stderr
