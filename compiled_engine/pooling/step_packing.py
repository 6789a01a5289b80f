"""Pack many inputs into varlen steps under the token budget (never padded to the longest)."""

from __future__ import annotations

from collections.abc import Sequence


def pack_steps(lengths: Sequence[int], token_budget: int, max_seqs: int) -> list[list[int]]:
    """Indices of `lengths` grouped into steps, in input order: a step holds at most `max_seqs`
    inputs and `token_budget` tokens (every length must fit the budget on its own)."""
    steps: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for index, length in enumerate(lengths):
        if length > token_budget:
            raise ValueError(f"input {index} has {length} tokens, more than a step's {token_budget}")
        if current and (tokens + length > token_budget or len(current) == max_seqs):
            steps.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += length
    if current:
        steps.append(current)
    return steps
