"""The seam between the scheduler and a draft model that proposes tokens (speculative decoding's
`draft_model` method).

The scheduler (core/) asks for proposals while it schedules a step; the draft runs on the worker
side (worker/draft_proposer.py), which the core does not import: the engine hands the scheduler
an object satisfying this protocol.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np


class DraftProposer(Protocol):
    def propose(
        self, request_id: str, token_ids: np.ndarray, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[int, ...]:
        """`num_tokens` proposed tokens after `token_ids` (the request's whole sequence, 1-D int).

        `block_ids` is the request's block list in the target's cache, already covering the
        sequence plus the proposals: the draft's cache has the same blocks, so its slots for
        these positions are the target's."""
        ...

    def forget(self, request_ids: Collection[str]) -> None:
        """Requests whose blocks went back to the pool (finished or preempted): what the draft
        wrote for them is no longer theirs."""
        ...
