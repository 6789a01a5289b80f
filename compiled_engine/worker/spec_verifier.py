"""Speculative decoding's acceptance rule: which proposed tokens the target model keeps.

A request with proposals d_1..d_k has k "proposal rows" of logits in its step: row j is the
target's distribution p_j for the token after d_1..d_j (row 0: after its newest known token),
verifying d_{j+1}. Its usual sampling row (the logits after d_k) gives the token that follows
when every proposal is kept.

- Greedy rows keep d_{j+1} while it is the argmax of p_j; at the first mismatch the argmax is the
  row's token. That is exactly the token sequence plain greedy decoding makes.
- Sampled rows (temperature > 0) use rejection sampling. For a proposal drawn from the draft
  model's distribution q_j: keep d with probability min(1, p_j(d) / q_j(d)); on rejection draw
  from max(0, p_j - q_j) renormalised, and stop (Leviathan et al.; vLLM's rule). Each emitted
  token is then distributed exactly as p_j: P(x) = min(q(x), p(x)) + (1 - Σ min(q, p)) ·
  max(0, p(x) - q(x)) / Σ max(0, p - q) = min(q, p)(x) + max(0, p - q)(x) = p(x).
  A deterministic proposal (n-gram, or a draft's argmax for greedy or constrained requests) is
  the point mass q = one-hot(d): keep d with probability p_j(d), on rejection draw from p_j with
  d removed: the same rule. p_j is the sampler's own (worker/sampler.py `target_probs`:
  temperature, min_p, top-k, top-p).

Everything runs on the logits' device and returns per proposal row (`accepted`, `recovered`): the
first rejected row of a request, and the number accepted before it, are found on the host
(`accepted_prefix`), where the step's tokens are read anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from compiled_engine.worker.sampler import (
    SamplingTensors,
    categorical_draw,
    greedy_tokens_of,
    target_probs,
    uniform_noise,
)


def acceptance_probability(
    probs: torch.Tensor, proposed: torch.Tensor, draft_probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Per row, the chance a proposal is kept: min(1, p(d) / q(d)) for a proposal drawn from the
    draft's q; p(d) for a point-mass proposal (`draft_probs` None)."""
    p = probs.gather(1, proposed[:, None]).squeeze(1)
    if draft_probs is None:
        return p
    # q(d) > 0: d was drawn from q (a one-hot row for point-mass proposals has q(d) = 1).
    q = draft_probs.gather(1, proposed[:, None]).squeeze(1).clamp_min(torch.finfo(probs.dtype).tiny)
    return (p / q).clamp(max=1.0)


def residual_probs(
    probs: torch.Tensor, proposed: torch.Tensor, draft_probs: torch.Tensor | None = None
) -> torch.Tensor:
    """What a rejected row draws from: max(0, p - q) for a proposal drawn from q; the target
    without the proposed token for a point-mass one (max(0, p - one-hot) is that too).
    Unnormalised: `categorical_draw` does not need the sum to be 1."""
    if draft_probs is None:
        return probs.scatter(1, proposed[:, None], 0.0)
    residual = (probs - draft_probs).clamp_min(0.0)
    # p == q leaves nothing, and then a rejection (p(d) / q(d) < 1) can come only from rounding:
    # draw from p itself there rather than from an all-zero row.
    return torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)


def verify_proposals(
    logits: torch.Tensor,
    proposed: torch.Tensor,
    params: SamplingTensors | None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposal rows' raw logits [D, vocab] and the token each verifies [D] → (`accepted` [D] bool,
    `recovered` [D] int64: the row's token if it turns out to be the first rejected one).

    `params` are the rows' sampling settings (SamplingTensors.select_rows), None when every row is
    greedy. `draft_probs` [D, vocab]: the distribution q each proposal was drawn from (a draft
    model sampling its proposals; one-hot rows for deterministic ones), None when every proposal
    is a point mass."""
    greedy_tokens = greedy_tokens_of(logits)
    greedy_accepted = greedy_tokens == proposed
    if params is None or params.all_greedy:
        return greedy_accepted, greedy_tokens
    probs = target_probs(logits.float(), params)
    keep = acceptance_probability(probs, proposed, draft_probs)
    accepted = uniform_noise(len(proposed), probs.device, params) < keep
    recovered = categorical_draw(residual_probs(probs, proposed, draft_probs), params)
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
