"""kernels/cpu_sampler.py: the C++ greedy pick against torch's own `argmax(dim=-1)`, and the C++
temperature draw against the draw's definition computed in float64."""

from __future__ import annotations

import pytest
import torch

from compiled_engine.kernels import cpu_sampler
from compiled_engine.kernels.cpu_sampler import greedy_pick, sampler_kernels_available, temperature_draw
from compiled_engine.worker import sampler

pytestmark = pytest.mark.skipif(
    not sampler_kernels_available(), reason="no C++ compiler: the kernel cannot be built"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Vocabularies shorter than a vector, a vector, past one (the tail loop), and the bench's.
VOCABS = (1, 7, 16, 17, 250, 4000, 4097)


def _rows(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits on few levels (so rows hold ties), some rows with NaN, -inf or signed zeros."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(-4, 5, (rows, vocab), generator=generator).to(torch.float32) / 2
    for r in range(rows):
        kind = r % 6
        if kind == 1:  # NaNs: argmax answers the first
            logits[r, torch.randint(vocab, (2,), generator=generator)] = float("nan")
        elif kind == 2:
            logits[r] = float("-inf")
        elif kind == 3:  # the largest value is a zero, of either sign, more than once
            logits[r] = -1.0
            logits[r, torch.randint(vocab, (3,), generator=generator)] = torch.tensor([0.0, -0.0, 0.0])
        elif kind == 4:
            logits[r] = float("nan")
        elif kind == 5:  # the largest value last
            logits[r, -1] = 100.0
    return logits.to(dtype)


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_argmax(dtype, simd) -> None:
    for vocab in VOCABS:
        logits = _rows(12, vocab, dtype, seed=vocab)
        assert torch.equal(greedy_pick(logits, simd=simd), logits.argmax(dim=-1)), vocab


def test_rows_at_any_stride_and_many_rows() -> None:
    base = _rows(9, 300, torch.bfloat16, seed=1)
    narrow = base[:, 5:260]  # rows 300 apart, a window of each
    assert torch.equal(greedy_pick(narrow), narrow.argmax(dim=-1))
    transposed = _rows(300, 9, torch.bfloat16, seed=2).t()  # unit stride down the rows: copied
    assert torch.equal(greedy_pick(transposed), transposed.argmax(dim=-1))
    expanded = _rows(1, 64, torch.float32, seed=3).expand(5, 64)  # one row, read five times
    assert torch.equal(greedy_pick(expanded), expanded.argmax(dim=-1))
    # Enough values to be shared out over the threads.
    many = _rows(80, 4000, torch.bfloat16, seed=4)
    assert torch.equal(greedy_pick(many), many.argmax(dim=-1))
    assert greedy_pick(torch.empty(0, 10)).shape == (0,)


def test_the_sampler_takes_it(monkeypatch) -> None:
    logits = _rows(64, 4000, torch.bfloat16, seed=5)
    calls = []

    def counting(x, simd=True):  # the kernel itself, counted
        calls.append(x.shape)
        return greedy_pick(x, simd)

    monkeypatch.setattr(sampler, "greedy_pick", counting)
    assert torch.equal(sampler.greedy_tokens_of(logits), logits.argmax(dim=-1))
    assert calls == [logits.shape]


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (torch.zeros(4), r"\[rows, vocab\] logits, got shape \(4,\)"),
        (torch.zeros(2, 3, 4), r"got shape \(2, 3, 4\)"),
        (torch.zeros(2, 3, dtype=torch.int64), "float32, bfloat16 or float16 logits, got torch.int64"),
        (torch.zeros(2, 0), r"at least one vocabulary entry"),
        (torch.zeros(2, 3, device="meta"), "runs on the CPU, got logits on meta"),
    ],
)
def test_bad_input_is_named(logits, message) -> None:
    with pytest.raises(ValueError, match=message):
        greedy_pick(logits)


def test_the_kernel_refuses_bad_sizes() -> None:
    """The C++ side's own checks (the Python side never passes these): code 1, nothing written."""
    out = torch.full((2,), -7, dtype=torch.int64)
    logits = torch.zeros(2, 8)
    kernel = cpu_sampler.load().ce_cpu_greedy
    assert kernel(logits.data_ptr(), 2, 0, 8, 0, 1, 1, out.data_ptr()) == 1  # no vocabulary
    assert kernel(logits.data_ptr(), 2, 8, 4, 0, 1, 1, out.data_ptr()) == 1  # rows overlapping
    assert kernel(logits.data_ptr(), 2, 8, 8, 7, 1, 1, out.data_ptr()) == 1  # no such dtype
    draw = cpu_sampler.load().ce_cpu_temperature_draw
    zero_t, u = torch.tensor([1.0, 0.0]), torch.zeros(2)
    assert draw(logits.data_ptr(), 2, 8, 8, 0, zero_t.data_ptr(), u.data_ptr(), 1, 1, out.data_ptr()) == 1
    assert out.tolist() == [-7, -7]


def _bracketed(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, tokens: torch.Tensor):
    """Each token is where u * total falls in the row's running sum of exp((x - max) / t), the sums
    taken in float64 (so up to float32 rounding of the kernel's own sums, 1e-5 of the total)."""
    x = logits.double()
    w = ((x - x.amax(dim=-1, keepdim=True)) / temperature.double()[:, None]).exp()
    cdf = w.cumsum(dim=-1)
    total = cdf[:, -1]
    target = uniform.double() * total
    slack = 1e-5 * total
    for r, k in enumerate(tokens.tolist()):
        below = cdf[r, k - 1] if k > 0 else torch.tensor(0.0, dtype=torch.float64)
        assert below <= target[r] + slack[r] and cdf[r, k] >= target[r] - slack[r], (r, k)
        assert w[r, k] > 0, (r, k)  # never a token of zero weight


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_draw_lands_where_u_falls(dtype, simd) -> None:
    for vocab in (1, 7, 16, 17, 250, 4097):
        generator = torch.Generator().manual_seed(vocab)
        rows = 40
        logits = (torch.randn(rows, vocab, generator=generator) * 3).to(dtype)
        logits[1, : vocab // 2] = float("-inf")  # some tokens impossible
        temperature = torch.rand(rows, generator=generator) * 2 + 0.05
        uniform = torch.rand(rows, generator=generator)
        uniform[0], uniform[2] = 0.0, 1.0 - 2**-24  # the ends of [0, 1)
        tokens = temperature_draw(logits, temperature, uniform, simd=simd)
        _bracketed(logits, temperature, uniform, tokens)


def test_the_draw_matches_torchs_softmax_and_cumsum() -> None:
    """On random rows the kernel's sums cross u * total where torch's float32 ones do (rounding
    could move a draw by one token at a boundary; none does on these rows)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 4096, generator=generator)
    temperature = torch.full((256,), 0.8)
    uniform = torch.rand(256, generator=generator)
    cdf = torch.softmax(logits / 0.8, dim=-1).cumsum(dim=-1)
    expected = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True).squeeze(1)
    assert torch.equal(temperature_draw(logits, temperature, uniform), expected)


def test_rows_the_draw_cannot_weigh() -> None:
    logits = torch.zeros(3, 20)
    logits[0, 5] = float("nan")  # a NaN: argmax's answer, its first NaN
    logits[1] = float("-inf")  # nothing drawable: 0, argmax's answer
    logits[2, :3] = float("-inf")  # u = 0: the first token of weight > 0
    tokens = temperature_draw(logits, torch.ones(3), torch.zeros(3))
    assert tokens.tolist() == [5, 0, 3]
    assert temperature_draw(torch.empty(0, 5), torch.ones(0), torch.zeros(0)).shape == (0,)


def test_the_sampler_draws_with_it_only_without_top_k_top_p_min_p(monkeypatch) -> None:
    from compiled_engine.sampling_params import SamplingParams

    calls = []

    def counting(*args, **kwargs):  # the kernel itself, counted
        calls.append(1)
        return temperature_draw(*args, **kwargs)

    monkeypatch.setattr(sampler, "temperature_draw", counting)
    logits = torch.randn(4, 100).to(torch.bfloat16)
    for params, used in (
        (SamplingParams(temperature=0.7), True),
        (SamplingParams(temperature=0.7, top_p=0.9), False),
        (SamplingParams(temperature=0.7, top_k=5), False),
        (SamplingParams(temperature=0.7, min_p=0.1), False),
    ):
        calls.clear()
        tensors = sampler.SamplingTensors.build(
            [params, SamplingParams(temperature=0.0)] * 2, [None] * 4, torch.device("cpu"),
            default_generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        tokens = sampler.Sampler()(logits, tensors)
        assert bool(calls) == used, params
        assert tokens[1] == logits[1].float().argmax() and tokens[3] == logits[3].float().argmax()


@pytest.mark.parametrize(
    ("temperature", "uniform", "message"),
    [
        (torch.ones(2), torch.zeros(3), r"uniform as float32 \[2\] on the CPU, got torch.float32 \(3,\)"),
        (torch.ones(2, dtype=torch.float64), torch.zeros(2), "temperature as float32"),
        (torch.tensor([1.0, 0.0]), torch.zeros(2), "positive finite temperatures"),
        (torch.tensor([1.0, float("inf")]), torch.zeros(2), "positive finite temperatures"),
    ],
)
def test_bad_draw_input_is_named(temperature, uniform, message) -> None:
    with pytest.raises(ValueError, match=message):
        temperature_draw(torch.zeros(2, 5), temperature, uniform)


@pytest.mark.slow  # a second build of the library: a few seconds of g++
@pytest.mark.parametrize("target", ["baseline", "avx2"])
def test_a_build_without_avx512_picks_and_draws_alike(target, monkeypatch, tmp_path) -> None:
    """Built for baseline x86-64 (no vector paths compiled in: `simd` changes nothing, the plain
    loops answer) or for x86-64-v3 (the AVX2 paths), the picks and draws answer as above, bf16,
    fp16 and float32, NaN rows and tails past whole vectors included."""
    import ctypes
    import platform

    from compiled_engine.kernels import cpu_attention_build

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the baseline build is x86-64's")
    if target == "avx2" and not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 + FMA + F16C build")
    march = "-march=x86-64" if target == "baseline" else "-march=x86-64-v3"
    flags = tuple(march if f == "-march=native" else f for f in cpu_attention_build.FLAGS)
    monkeypatch.setattr(cpu_attention_build, "FLAGS", flags)
    library = ctypes.CDLL(str(cpu_attention_build.build(tmp_path, cpu_sampler.SOURCE)))
    cpu_sampler._declare(library)
    assert library.ce_cpu_sampler_simd() == (0 if target == "baseline" else 256)
    out = torch.empty(12, dtype=torch.int64)
    for dtype in DTYPES:
        logits = _rows(12, 4097, dtype, seed=9)
        logits[3, 2050] = float("nan")
        code = library.ce_cpu_greedy(
            logits.data_ptr(), 12, 4097, 4097, cpu_sampler.SAMPLER_DTYPES[dtype], 1, 2, out.data_ptr()
        )
        assert code == 0
        assert torch.equal(out, logits.argmax(dim=-1)), dtype
    logits = torch.randn(12, 4097, generator=torch.Generator().manual_seed(9))
    temperature, uniform = torch.full((12,), 0.7), torch.rand(12, generator=torch.Generator().manual_seed(10))
    code = library.ce_cpu_temperature_draw(
        logits.data_ptr(), 12, 4097, 4097, 0, temperature.data_ptr(), uniform.data_ptr(), 1, 2, out.data_ptr()
    )
    assert code == 0
    _bracketed(logits, temperature, uniform, out)


def _cpu_flags() -> frozenset[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.split(":", 1)[-1].split())
