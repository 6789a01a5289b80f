"""The widened linear (kernels/widened_linear.py) and its pass (graphs/passes/widened_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from compiled_engine.graphs.gemv_policy import GemvDecision
from compiled_engine.graphs.pass_manager import BucketTarget
from compiled_engine.graphs.pass_pipeline import default_pass_manager
from compiled_engine.graphs.passes.widened_linear import WidenLinears
from compiled_engine.kernels import widened_linear as widened_module
from compiled_engine.kernels.widened_linear import widened_linear, widened_linear_available

DTYPES = (torch.bfloat16, torch.float16)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact product (float64: every bf16 / fp16 product and these sums are exact enough),
    rounded once to the inputs' dtype."""
    out = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
    return out.to(x.dtype)


def _within_one_rounding(out: torch.Tensor, reference: torch.Tensor) -> None:
    # The op sums in fp32 and rounds once: each value is the exact one rounded, or its neighbour
    # when the fp32 sum lay within fp32 error of a rounding boundary.
    spacing = torch.finfo(out.dtype).eps * reference.double().abs().clamp_min(torch.finfo(out.dtype).tiny)
    assert ((out.double() - reference.double()).abs() <= spacing).all()
    assert (out == reference).float().mean() > 0.97


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_matches_the_exact_product_rounded_once(dtype, with_bias, rows) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 19, generator=g).to(dtype)
    x = torch.randn(rows, 19, generator=g).to(dtype)
    bias = torch.randn(37, generator=g).to(dtype) if with_bias else None
    out = widened_linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, 37)
    _within_one_rounding(out, _reference(x, weight, bias))


def test_weights_larger_than_the_scratch_are_widened_block_by_block(monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 24, generator=g).bfloat16()
    bias = torch.randn(70, generator=g).bfloat16()
    x = torch.randn(2, 3, 24, generator=g).bfloat16()  # leading dims kept
    whole = widened_linear(x, weight, bias)
    # 64 floats: blocks of two output features, the last block short (70 = 35 x 2).
    monkeypatch.setattr(widened_module, "SCRATCH_ELEMENTS", 48)
    blocked = widened_linear(x, weight, bias)
    assert blocked.shape == (2, 3, 70)
    assert torch.equal(blocked, whole)
    _within_one_rounding(blocked.reshape(6, 70), _reference(x.reshape(6, 24), weight, bias))


def test_strided_inputs_and_a_reused_scratch() -> None:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(64, 40, generator=g).bfloat16()
    small = torch.randn(8, 40, generator=g).bfloat16()
    x = torch.randn(40, 6, generator=g).bfloat16().t()  # non-contiguous rows
    first = widened_linear(x, big, None)
    second = widened_linear(x, small, None)  # a smaller weight in the grown scratch
    _within_one_rounding(first, _reference(x, big, None))
    _within_one_rounding(second, _reference(x, small, None))
    assert torch.equal(widened_linear(x, big, None), first)


@pytest.mark.parametrize(
    ("x", "weight", "bias", "message"),
    [
        (torch.ones(2, 4), torch.ones(3, 4), None, "bfloat16 or float16"),
        (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(3, 4, dtype=torch.float16), None, "one dtype"),
        (
            torch.ones(2, 5, dtype=torch.bfloat16),
            torch.ones(3, 4, dtype=torch.bfloat16),
            None,
            "does not match",
        ),
        (
            torch.ones(2, 4, dtype=torch.bfloat16),
            torch.ones(12, dtype=torch.bfloat16),
            None,
            "does not match",
        ),
        (
            torch.ones(2, 4, dtype=torch.bfloat16),
            torch.ones(3, 4, dtype=torch.bfloat16),
            torch.ones(4, dtype=torch.bfloat16),
            "bias",
        ),
    ],
)
def test_bad_inputs_are_named(x, weight, bias, message) -> None:
    with pytest.raises(ValueError, match=message):
        widened_linear(x, weight, bias)


def test_availability() -> None:
    assert widened_linear_available(torch.bfloat16) and widened_linear_available(torch.float16, "cpu")
    assert not widened_linear_available(torch.float32)
    assert not widened_linear_available(torch.bfloat16, "meta")


class _TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("w_half", torch.randn(12, 8).bfloat16())
        self.register_buffer("w_full", torch.randn(8, 12))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = F.linear(x, self.w_half)
        return y, F.linear(y.float(), self.w_full)


def test_the_pass_widens_half_precision_constant_linears_only() -> None:
    module = _TwoLinears()
    gm = fx.symbolic_trace(module)
    x = torch.randn(3, 8).bfloat16()
    expected = gm(x)
    result = WidenLinears()(gm)
    gm.recompile()
    assert result.nodes_rewritten == 1
    assert any("not widened" in note for note in result.notes)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert widened_linear in targets and F.linear in targets
    half, full = gm(x)
    _within_one_rounding(half, _reference(x, module.w_half, None))
    torch.testing.assert_close(full, expected[1], rtol=1e-2, atol=1e-2)


def test_the_pipeline_widens_where_the_policy_chose_it() -> None:
    decision = GemvDecision((), kernel_rows=(1,), widened_rows=(8,), widens_dynamic=True)

    def ran(bucket: int | None) -> list[str]:
        gm = fx.symbolic_trace(lambda x: x + 1)
        report = default_pass_manager("AnyModel", 1).run_bucket(
            gm, BucketTarget(bucket, 4, "cpu", "cpu", decision)
        )
        return [r.pass_name for r in report.results]

    assert ran(1) == ["cpu_gemv_linears"]
    assert ran(8) == ["widen_linears"]
    assert ran(None) == ["widen_linears"]
    assert ran(4) == []


@pytest.mark.slow
def test_an_engine_with_widened_linears_scores_prompts_as_the_eager_bf16_engine(
    llama_dir, monkeypatch, tmp_path
):
    from compiled_engine import LLM, SamplingParams
    from compiled_engine.graphs.compiled_step import CompiledStep

    def widened_where_unlowered(step):
        return GemvDecision((), widened_rows=tuple(step.buckets), widens_dynamic=True)

    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(24)] for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)

    def scores(**options) -> list[list[float]]:
        llm = LLM(llama_dir, dtype="bfloat16", max_num_seqs=4, compile_buckets=(1, 4), **options)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if not options.get("enforce_eager"):
            builds = llm.engine.model_runner.step_graph.builds
            assert builds[None].variant.widened_linears  # prompt logprobs run the dynamic graph
        return [[next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]] for out in outputs]

    eager = scores(enforce_eager=True)
    monkeypatch.setattr(CompiledStep, "gemv_decision", widened_where_unlowered)
    widened = scores(enforce_eager=False, cache_dir=str(tmp_path))
    for ours, theirs in zip(widened, eager, strict=True):
        # bf16 activations: the two sum in other orders and round in other places.
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0.0, atol=0.08)
