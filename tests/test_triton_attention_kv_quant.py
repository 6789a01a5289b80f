"""The Triton kernels on a quantized KV cache (int8 / fp8 e4m3 rows with per-token, per-head scales),
against the reference op on the same quantized cache: the write kernel's codes and scales, the
split-KV decode and the extend kernel's outputs. Under the Triton interpreter without a GPU (as
tests/test_triton_attention.py, whose conventions this follows; tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton attention backend needs the triton package (Linux x86_64)")

import compiled_engine.kernels  # noqa: E402, F401  (registers the ops)
from compiled_engine.kernels import kv_quant, triton_attention  # noqa: E402
from compiled_engine.kernels.reference import paged_attention_reference  # noqa: E402
from tests.attention_batches import Batch, make_attention_batch, quantized_cache  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

if not ON_GPU and not triton_attention.KERNELS_INTERPRETED:
    pytest.skip("no GPU and triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

QUANTIZED = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
# Both sides dequantize the same codes in float32 (the dots upcast: query and cache dtypes differ).
SAME_CODES_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def check_against_reference(batch: Batch, dtype: torch.dtype, scale: float, **options) -> torch.Tensor:
    cache = quantized_cache(batch.kv_cache, dtype)
    triton_cache, reference_cache = cache.clone(), cache.clone()
    sliding_window, softcap = options.get("sliding_window", -1), options.get("softcap", 0.0)
    out = torch.ops.compiled_engine.paged_attention_triton(
        *batch.args(triton_cache), scale, sliding_window, softcap
    )
    expected = paged_attention_reference(*batch.args(reference_cache), scale, sliding_window, softcap)
    assert out.dtype == batch.query.dtype and not out.isnan().any()
    torch.testing.assert_close(out, expected, **SAME_CODES_TOL[batch.query.dtype])
    compared = slice(None) if batch.num_pad_rows <= 1 else slice(0, -1)
    kernel_bytes = triton_cache[:, compared].view(torch.uint8).cpu().int()
    reference_bytes = reference_cache[:, compared].view(torch.uint8).cpu().int()
    if ON_GPU:
        # The GPU's float32 division may round x / scale one ulp apart: a code may differ by one.
        codes = slice(0, batch.query.shape[2])
        assert (kernel_bytes[..., codes] - reference_bytes[..., codes]).abs().max() <= 1
        scales = slice(kv_quant.scale_offset(batch.query.shape[2]), None)
        assert torch.equal(kernel_bytes[..., scales], reference_bytes[..., scales])
    else:
        assert torch.equal(kernel_bytes, reference_bytes), (
            "the write kernel's codes differ from the reference's"
        )
    return out


CASES = {
    # T == S: the split-KV decode kernel; three partitions for the longest context.
    "decode_gqa_d64_three_partitions": (
        [(1100, 1), (40, 1), (0, 1)],
        dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16),
        {},
    ),
    # The extend kernel: odd head count and size, window, soft cap and padding rows.
    "extend_odd_d20_bs5_window_softcap_padding": (
        [(10, 7), (3, 2), (0, 0)],
        dict(num_q_heads=6, num_kv_heads=3, head_dim=20, block_size=5, num_pad_rows=2),
        dict(sliding_window=6, softcap=0.5),
    ),
}


@pytest.mark.parametrize(
    "query_dtype",
    [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference_on_the_same_quantized_cache(case, dtype, query_dtype):
    spans, batch_options, attention_options = CASES[case]
    batch = make_attention_batch(spans, dtype=query_dtype, device=DEVICE, **batch_options)
    check_against_reference(batch, dtype, batch.query.shape[2] ** -0.5, **attention_options)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_write_kernel_encodes_ties_subnormals_and_extremes_as_torch(dtype):
    # Rows whose amax is QMAX (scale 1): the codes are the values rounded (every e4m3 value and
    # the midpoints between neighbours; int8 half-integers), and a zero row.
    qmax = kv_quant.QMAX[dtype]
    if dtype == torch.float8_e4m3fn:
        finite = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        finite = finite[finite.isfinite()].unique()
        values = torch.cat([finite, (finite[1:] + finite[:-1]) / 2])
    else:
        values = torch.cat([torch.arange(-127, 127) + 0.5, torch.linspace(-3, 3, 97)])
    head_dim = 31
    rows = -(-values.numel() // (head_dim - 1))
    values = torch.cat([values, torch.zeros(rows * (head_dim - 1) - values.numel())]).view(rows, head_dim - 1)
    values = torch.cat([values, torch.full((rows, 1), qmax)], dim=1)
    values[-1] = 0.0
    batch = make_attention_batch([(0, rows)], num_q_heads=1, num_kv_heads=1, head_dim=head_dim, device=DEVICE)
    batch.key, batch.value = values[:, None].to(DEVICE), -values[:, None].to(DEVICE)
    check_against_reference(batch, dtype, 0.1)
