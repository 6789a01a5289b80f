"""The record the model runner returns to the scheduler each step."""

from __future__ import annotations

from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """Log-probabilities at one position, from the raw model logits (docs/sampling.md)."""

    token_id: int  # the token that came next: the sampled one, or the next prompt token
    logprob: float
    rank: int  # 1 = the most likely token (vLLM's: tokens at least as likely, itself included)
    top_token_ids: tuple[int, ...]  # the N most likely tokens, best first
    top_logprobs: tuple[float, ...]


class PromptLogprobs(NamedTuple):
    """Prompt log-probabilities a step computed for one request's chunk of prompt."""

    # Entry i describes prompt token first_position + 1 + i, from the logits at position first_position + i.
    first_position: int
    entries: tuple[TokenLogprobs, ...]


class ModelRunnerOutput(NamedTuple):
    # One entry per scheduled request with sample=True, in scheduling order.
    request_ids: tuple[str, ...]
    sampled_token_ids: tuple[int, ...]
    # Aligned with request_ids: the sampled token's logprobs for rows that asked (logprobs=N),
    # None for the others; None when no row asked.
    logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # Per request with prompt_logprobs whose prompt this step computed (a chunk of it).
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    # Speculative decoding, aligned with request_ids: how many of each row's proposed tokens were
    # accepted (0 for rows without proposals); its sampled token comes after them. None: no row
    # of the step had proposals.
    num_accepted_drafts: tuple[int, ...] | None = None
    # Rows with proposals that asked for logprobs: one record per token the row emits (its
    # accepted proposals, then its sampled token), in order.
    draft_logprobs: dict[str, tuple[TokenLogprobs, ...]] | None = None
    # Multi-step runs (ScheduledRequest.num_steps > 1), aligned with request_ids: each row's tokens,
    # one per step, in order (the first is sampled_token_ids' entry). None: a plain step.
    step_token_ids: tuple[tuple[int, ...], ...] | None = None
