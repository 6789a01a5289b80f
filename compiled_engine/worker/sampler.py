"""Turns the last-position logits of the sampling rows into next tokens, on the logits' device.

Greedy rows take the argmax of the raw logits. The others go temperature → top-k → top-p →
a draw by the exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. picks token i with
probability probs[i]. Drawing E apart from the logits maths lets a seeded request take its noise
from its own generator — so its tokens depend only on its seed and its logits, never on which
other requests share the batch — while the maths stays one vectorised pass over all rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compiled_engine.sampling_params import SamplingParams

# Goes into the compile-cache key of anything that captures the sampler.
SAMPLER_VERSION = "sampler-1"


@dataclass(frozen=True, eq=False)  # eq on tensor fields would be elementwise, not a bool
class SamplingTensors:
    """Per-row sampling settings as device tensors, plus host-side flags that pick fast paths."""

    temperature: torch.Tensor  # [K] float32; 1.0 on greedy rows so dividing by it is harmless
    top_k: torch.Tensor  # [K] int64; -1 = no limit
    top_p: torch.Tensor  # [K] float32; 1.0 = no limit
    greedy: torch.Tensor  # [K] bool
    # Per row: the generator a seeded row draws its noise from, else None.
    generators: tuple[torch.Generator | None, ...]
    # Unseeded rows share one draw from this (None: torch's global generator).
    default_generator: torch.Generator | None
    all_greedy: bool
    needs_top_k: bool
    needs_top_p: bool

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        *,
        default_generator: torch.Generator | None = None,
    ) -> SamplingTensors:
        if len(generators) != len(params_list):
            raise ValueError(
                f"need one generator (or None) per row: got {len(params_list)} params "
                f"and {len(generators)} generators"
            )
        device = torch.device(device)
        for gen in [*generators, default_generator]:
            if gen is not None and gen.device.type != device.type:
                raise ValueError(f"generator on {gen.device} cannot draw noise for logits on {device}")
        greedy = [p.greedy for p in params_list]
        # Built on the host and copied once: one small transfer per step instead of one per field.
        temperature = [1.0 if g else float(p.temperature) for p, g in zip(params_list, greedy, strict=True)]
        top_k = [p.top_k for p in params_list]
        top_p = [float(p.top_p) for p in params_list]
        # Greedy rows ignore top-k/top-p, so they never force the slow path.
        sampled = [not g for g in greedy]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32).to(device, non_blocking=True),
            top_k=torch.tensor(top_k, dtype=torch.int64).to(device, non_blocking=True),
            top_p=torch.tensor(top_p, dtype=torch.float32).to(device, non_blocking=True),
            greedy=torch.tensor(greedy, dtype=torch.bool).to(device, non_blocking=True),
            generators=tuple(None if g else gen for g, gen in zip(greedy, generators, strict=True)),
            default_generator=default_generator,
            all_greedy=all(greedy),
            needs_top_k=any(s and k != -1 for s, k in zip(sampled, top_k, strict=True)),
            needs_top_p=any(s and p < 1.0 for s, p in zip(sampled, top_p, strict=True)),
        )


class Sampler:
    """Stateless: every per-request setting and generator arrives in SamplingTensors."""

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
        if logits.shape[0] != params.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows but sampling params have {params.num_rows}")
        greedy_tokens = logits.argmax(dim=-1)
        if params.all_greedy:
            return greedy_tokens

        logits = logits.float()
        # Subtract the row max before dividing: (x - max) / t stays <= 0, so a tiny temperature
        # sends the losers to -inf instead of overflowing to inf - inf = NaN.
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature[:, None]
        if params.needs_top_k or params.needs_top_p:
            scaled = _apply_top_k_top_p(scaled, params)
        probs = scaled.softmax(dim=-1)

        noise = _exponential_noise(probs.shape, probs.device, params)
        sampled_tokens = (probs / noise).argmax(dim=-1)
        return torch.where(params.greedy, greedy_tokens, sampled_tokens)


def _apply_top_k_top_p(scaled: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Mask everything outside each row's top-k and then its nucleus to -inf (one sort, all rows)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    if params.needs_top_k:
        k = torch.where(params.top_k < 0, vocab, params.top_k.clamp(max=vocab))
        rank = torch.arange(vocab, device=scaled.device)
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    if params.needs_top_p:
        # Nucleus over what top-k left: keep a token while the mass strictly before it is below
        # top_p. The best token has zero mass before it, so every row keeps at least one.
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # top_p == 1 rows are left alone: rounding in the cumsum could otherwise drop their tail.
        outside = (mass_before >= params.top_p[:, None]) & (params.top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def _exponential_noise(shape: torch.Size, device: torch.device, params: SamplingTensors) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_(generator=params.default_generator)
    for row, gen in enumerate(params.generators):
        if gen is not None:
            noise[row] = torch.empty(shape[-1], device=device).exponential_(generator=gen)
    # An exact 0 would turn a masked token's 0 probability into 0/0 = NaN, which argmax picks.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
