"""Speculative decoding's acceptance rule: which proposed tokens the target model keeps.

A request with proposals d_1..d_k has k "proposal rows" of logits in its step: row j is the
target's distribution p_j for the token after d_1..d_j (row 0: after its newest known token),
verifying d_{j+1}. Its usual sampling row (the logits after d_k) gives the token that follows
when every proposal is kept.

- Greedy rows keep d_{j+1} while it is the argmax of p_j; at the first mismatch the argmax is the
  row's token. That is exactly the token sequence plain greedy decoding makes.
- Sampled rows (temperature > 0) use rejection sampling for a point-mass proposal (n-gram
  proposals have no distribution of their own): keep d_{j+1} with probability p_j(d_{j+1}); on
  rejection draw from p_j with d_{j+1} removed and renormalised, and stop. Each emitted token is
  then distributed exactly as p_j (kept: p_j(d); drawn after a rejection: (1 - p_j(d)) ·
  p_j(x) / (1 - p_j(d)) = p_j(x) for x != d), so the output distribution is the target's.
  p_j is the sampler's own (worker/sampler.py `target_probs`: temperature, min_p, top-k, top-p).

Everything runs on the logits' device and returns per proposal row (`accepted`, `recovered`): the
first rejected row of a request, and the number accepted before it, are found on the host
(`accepted_prefix`), where the step's tokens are read anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from compiled_engine.worker.sampler import SamplingTensors, categorical_draw, target_probs, uniform_noise


def acceptance_probability(probs: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
    """Per row, the chance a proposal is kept: the target's probability of the proposed token."""
    return probs.gather(1, proposed[:, None]).squeeze(1)


def residual_probs(probs: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
    """What a rejected row draws from: the target without the proposed token (unnormalised:
    `categorical_draw` does not need the sum to be 1)."""
    return probs.scatter(1, proposed[:, None], 0.0)


def verify_proposals(
    logits: torch.Tensor, proposed: torch.Tensor, params: SamplingTensors | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposal rows' raw logits [D, vocab] and the token each verifies [D] → (`accepted` [D] bool,
    `recovered` [D] int64: the row's token if it turns out to be the first rejected one).

    `params` are the rows' sampling settings (SamplingTensors.select_rows), None when every row is
    greedy."""
    greedy_tokens = logits.argmax(dim=-1)
    greedy_accepted = greedy_tokens == proposed
    if params is None or params.all_greedy:
        return greedy_accepted, greedy_tokens
    probs = target_probs(logits.float(), params)
    accepted = uniform_noise(len(proposed), probs.device, params) < acceptance_probability(probs, proposed)
    residual = residual_probs(probs, proposed)
    recovered = categorical_draw(residual, params)
    return (
        torch.where(params.greedy, greedy_accepted, accepted),
        torch.where(params.greedy, greedy_tokens, recovered),
    )


def accepted_prefix(accepted: Sequence[bool], start: int, num_proposed: int) -> int:
    """How many of a request's proposals (rows start .. start + num_proposed - 1) are kept: those
    before its first rejected one."""
    for j in range(num_proposed):
        if not accepted[start + j]:
            return j
    return num_proposed
