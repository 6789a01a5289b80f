"""Prompt-lookup (n-gram) proposals: guess a request's next tokens from its own history.

The request's last n tokens (its suffix n-gram, prompt_lookup_max >= n >= prompt_lookup_min) are
looked up earlier in its prompt and outputs; the tokens that followed the match are the proposal.
The longest n that matches wins, and among its matches the most recent one with a whole proposal
after it (code repeats what was written nearby), else the most recent one. Pure numpy on the
host, in the scheduler: no model, no device.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, tokens: np.ndarray, max_tokens: int) -> tuple[int, ...]:
        """Up to `max_tokens` proposed next tokens after `tokens` (1-D int array); () when no
        suffix n-gram of an allowed length occurs earlier."""
        length = len(tokens)
        if max_tokens < 1 or length <= self.min_n:
            return ()
        # Ends of earlier occurrences of the last token (never the last position itself), then
        # filtered one token further back at a time: `ends` holds the ends of matches of length n.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        best: np.ndarray | None = ends if self.min_n == 1 else None
        for n in range(2, self.max_n + 1):
            if not len(ends):
                break
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
            if len(ends) and n >= self.min_n:
                best = ends
        if best is None or not len(best):
            return ()
        # The most recent match with max_tokens tokens after it, else the most recent one: in a
        # run of repeats (indentation, "0, 0, 0") the latest match overlaps the suffix itself and
        # has one token after it, where an earlier one proposes a whole run.
        whole = best[best <= length - 1 - max_tokens]
        start = int(whole[-1] if len(whole) else best[-1]) + 1
        return tuple(tokens[start : start + max_tokens].tolist())
