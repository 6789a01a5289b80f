"""The quantized KV cache (kernels/kv_quant.py): its maths and error bounds, the reference op on it
against the unquantized reference, how it is sized and allocated, and its option's bad input."""

from __future__ import annotations

import pytest
import torch

import compiled_engine.kernels  # noqa: F401  (registers the ops)
from compiled_engine.engine_args import KV_CACHE_DTYPE_CHOICES, EngineArgs
from compiled_engine.kernels import kv_quant
from compiled_engine.kernels.reference import paged_attention_reference
from compiled_engine.worker import kv_cache
from tests.attention_batches import make_attention_batch, quantized_cache
from tests.test_engine_args import MODEL_CONFIG

QUANTIZED = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]


def test_option_names_are_the_layouts_names():
    assert tuple(kv_quant.KV_CACHE_DTYPES) == KV_CACHE_DTYPE_CHOICES


def test_row_layout_packs_codes_padding_and_an_aligned_scale():
    assert kv_quant.row_width(64, torch.bfloat16) == 64
    assert kv_quant.row_width(64, torch.int8) == 68
    assert kv_quant.row_width(5, torch.float8_e4m3fn) == 12  # 5 codes, 3 bytes of padding, scale
    rows = kv_quant.pack_rows(torch.tensor([[1.0, -2.0, 0.5, 3.0, -0.25]]), torch.int8)
    codes, scales = kv_quant.split_rows(rows, 5)
    assert scales.item() == pytest.approx(3.0 / 127)
    assert codes.tolist() == [[42, -85, 21, 127, -11]]  # round(x / scale), ties to even
    assert rows[0, 5:8].tolist() == [0, 0, 0]


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_round_trip_error_is_within_half_a_step(dtype):
    gen = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes, one all-zero row, one with a single outlier.
    x = torch.randn(64, 7, 24, generator=gen) * torch.logspace(-6, 4, 64)[:, None, None]
    x[3] = 0.0
    x[5, 2, 11] = 1e3
    codes, scales = kv_quant.quantize(x, dtype)
    back = kv_quant.dequantize(codes, scales)
    assert back.shape == x.shape and codes.dtype == dtype and scales.dtype == torch.float32
    assert torch.equal(back[3], torch.zeros_like(back[3]))
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        # Uniform steps of amax / 127: off by at most half a step.
        bound = amax / 127 / 2 * (1 + 1e-5)
    else:
        # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; subnormals step by 2^-9.
        bound = torch.maximum(x.abs() * 2**-4, amax / 448 * 2**-10) * (1 + 1e-5)
    assert ((back - x).abs() <= bound).all()
    # The largest element of each row is represented (near) exactly: scales are per row.
    assert torch.allclose(back.abs().amax(-1), amax.squeeze(-1), rtol=1e-6)


SHAPES = {
    # Odd head counts and head sizes (not multiples of 4: padding before the scale), GQA and MQA.
    "gqa_3x1_d5_bs3": (
        [(7, 3), (0, 4), (11, 1)],
        dict(num_q_heads=3, num_kv_heads=1, head_dim=5, block_size=3),
    ),
    "gqa_6x3_d20_bs4_padding": (
        [(9, 2), (2, 5)],
        dict(num_q_heads=6, num_kv_heads=3, head_dim=20, block_size=4, num_pad_rows=2),
    ),
    "mha_5x5_d64_bs16": (
        [(40, 1), (3, 1), (0, 9)],
        dict(num_q_heads=5, num_kv_heads=5, head_dim=64, block_size=16),
    ),
}
# Output bounds against the unquantized reference on randn inputs (|x| <~ 4): a value moves by at
# most half a step (int8: amax / 254 ~ 0.016; fp8: 2^-4 of itself, ~0.25 at 4), and the output is
# a convex combination of values under slightly moved weights.
OUTPUT_ATOL = {torch.int8: 0.06, torch.float8_e4m3fn: 0.3}


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_on_a_quantized_cache_is_close_to_the_unquantized_one(shape, dtype):
    spans, options = SHAPES[shape]
    batch = make_attention_batch(spans, **options)
    head_dim = batch.query.shape[2]
    plain_cache, quant_cache = batch.kv_cache.clone(), quantized_cache(batch.kv_cache, dtype)
    expected = paged_attention_reference(*batch.args(plain_cache), head_dim**-0.5)
    out = paged_attention_reference(*batch.args(quant_cache), head_dim**-0.5)
    assert out.dtype == batch.query.dtype and not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=OUTPUT_ATOL[dtype], rtol=0)
    # What the op wrote is this step's keys and values quantized, in their slots.
    slots = batch.slot_mapping[batch.slot_mapping >= 0]
    block_size = quant_cache.shape[2]
    written = quant_cache[:, slots // block_size, slots % block_size]
    real_rows = slots.shape[0]
    expected_rows = kv_quant.pack_rows(torch.stack((batch.key, batch.value))[:, :real_rows], dtype)
    assert torch.equal(written.view(torch.uint8), expected_rows.view(torch.uint8))


def test_a_quantized_cache_of_the_wrong_row_width_is_refused():
    batch = make_attention_batch([(5, 2)], head_dim=16)
    cache = torch.zeros(2, *batch.kv_cache.shape[1:4], 16, dtype=torch.int8)  # D, not D + scale
    with pytest.raises(ValueError, match="packed rows of 20 bytes for head dim 16"):
        paged_attention_reference(*batch.args(cache), 0.25)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_sizing_counts_codes_and_scales(dtype):
    # bench-small's attention: 6 layers, 4 kv heads of 64, blocks of 16.
    plain = kv_cache.bytes_per_block(6, 16, 4, 64, torch.bfloat16)
    quant = kv_cache.bytes_per_block(6, 16, 4, 64, dtype)
    assert quant == 2 * 6 * 16 * 4 * (64 + 4)
    memory = 64 * 2**20
    plain_blocks = kv_cache.blocks_for_memory(memory, plain)
    quant_blocks = kv_cache.blocks_for_memory(memory, quant)
    # Twice the blocks for the same memory, less what the scales take (4 bytes per 64 codes).
    assert quant_blocks == memory // quant - 1 and 1.85 * plain_blocks < quant_blocks < 2 * plain_blocks
    (cache,) = kv_cache.allocate_kv_caches(1, 3, 16, 4, 64, dtype, "cpu")
    assert cache.dtype == dtype and cache.shape == (2, 4, 16, 4, 68)
    assert cache.numel() * cache.element_size() == 4 * quant // 6


def test_engine_config_resolves_the_option_and_its_alias():
    assert EngineArgs().kv_cache_dtype == "auto"
    for given, resolved in (("auto", "auto"), ("int8", "int8"), ("fp8", "fp8"), ("fp8_e4m3", "fp8")):
        config = EngineArgs(kv_cache_dtype=given).create_engine_config(torch.device("cpu"), MODEL_CONFIG)
        assert config.kv_cache_dtype == resolved
        assert kv_quant.canonical_kv_cache_dtype(given) == resolved
    assert kv_quant.storage_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_quant.storage_dtype("int8", torch.float32) == torch.int8
    assert kv_quant.storage_dtype("auto", torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("bad", ["int4", "fp8_e5m2", "INT8", "", None, 8])
def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match=r"unknown kv_cache_dtype .*auto, int8, fp8, fp8_e4m3"):
        EngineArgs(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        kv_quant.canonical_kv_cache_dtype(bad)


def test_a_backend_that_cannot_read_a_quantized_cache_is_named():
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='int8' cannot run on attention_backend='flashinfer'"
    ):
        EngineArgs(kv_cache_dtype="int8", attention_backend="flashinfer")
    EngineArgs(kv_cache_dtype="auto", attention_backend="flashinfer")  # unquantized: resolved later


def test_every_command_takes_the_flag():
    from compiled_engine.entrypoints.cli import _build_parser

    parser = _build_parser()
    for command in (["generate", "hi"], ["warmup"], ["serve"]):
        args = parser.parse_args([*command, "--kv-cache-dtype", "fp8_e4m3"])
        assert EngineArgs.from_cli_args(args).kv_cache_dtype == "fp8_e4m3", command
        assert parser.parse_args(command).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--kv-cache-dtype", "int4"])


def test_llm_refuses_bad_values_before_reading_the_model(tmp_path):
    from compiled_engine import LLM

    missing = str(tmp_path / "no-such-model")  # never read: the options are refused first
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'"):
        LLM(model=missing, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="cannot run on attention_backend='flashinfer'"):
        LLM(model=missing, kv_cache_dtype="fp8", attention_backend="flashinfer")


def test_the_cache_dtype_keys_the_compile_cache():
    from compiled_engine.graphs.compile_manifest import GraphOptions, build_manifest, diff_fields

    def options(kv_cache_dtype):
        return GraphOptions(
            dtype=torch.float32,
            block_size=16,
            buckets=(1, 2),
            max_num_seqs=4,
            max_num_batched_tokens=64,
            kv_cache_shape=(2, 16, 2, 20),
            fuse_linears=True,
            attention_backend="cpu",
            kv_cache_dtype=kv_cache_dtype,
        )

    model = torch.nn.Linear(2, 2)  # the model's fields are the same for every option here
    manifests = {
        dtype: build_manifest(model, options(dtype), torch.device("cpu"), {})
        for dtype in (None, torch.int8, torch.float8_e4m3fn)
    }
    assert manifests[None]["engine.kv_cache_dtype"] == "auto"
    # int8 and fp8 caches have one shape: only the dtype tells their graphs apart.
    assert diff_fields(manifests[torch.int8], manifests[torch.float8_e4m3fn]) == ["engine.kv_cache_dtype"]
    assert diff_fields(manifests[None], manifests[torch.int8]) == ["engine.kv_cache_dtype"]
