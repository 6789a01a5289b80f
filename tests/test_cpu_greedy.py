"""kernels/cpu_greedy.py: the C++ greedy pick against torch's own `argmax(dim=-1)`."""

from __future__ import annotations

import pytest
import torch

from compiled_engine.kernels import cpu_greedy
from compiled_engine.kernels.cpu_greedy import greedy_kernel_available, greedy_pick
from compiled_engine.worker import sampler

pytestmark = pytest.mark.skipif(
    not greedy_kernel_available(), reason="no C++ compiler: the kernel cannot be built"
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


@pytest.mark.parametrize("simd", [True, False], ids=["avx512", "plain"])
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
    kernel = cpu_greedy.load().ce_cpu_greedy
    assert kernel(logits.data_ptr(), 2, 0, 8, 0, 1, 1, out.data_ptr()) == 1  # no vocabulary
    assert kernel(logits.data_ptr(), 2, 8, 4, 0, 1, 1, out.data_ptr()) == 1  # rows overlapping
    assert kernel(logits.data_ptr(), 2, 8, 8, 7, 1, 1, out.data_ptr()) == 1  # no such dtype
    assert out.tolist() == [-7, -7]
