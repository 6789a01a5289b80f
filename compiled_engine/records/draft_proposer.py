"""The seam between the scheduler and a draft model that proposes tokens (speculative decoding's
`draft_model` method).

The scheduler (core/) asks for proposals while it schedules a step; the draft runs on the worker
side (worker/draft_loop_proposer.py, worker/draft_proposer.py), which the core does not import:
the engine hands the scheduler an object satisfying this protocol.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

import numpy as np


class DraftSampling(NamedTuple):
    """How a request's proposals are chosen: the draft's argmax (temperature 0: greedy requests,
    constrained ones), or drawn from softmax(draft logits / temperature)."""

    temperature: float = 0.0
    seed: int | None = None  # a seeded request's draws depend only on its seed and progress
    num_output_tokens: int = 0


GREEDY_DRAFT = DraftSampling()


class DraftProposal(NamedTuple):
    token_ids: tuple[int, ...]
    # [len(token_ids), vocab] float32: the distribution q each proposal was drawn from, which the
    # verifier's min(1, p/q) rule needs; None when the proposals are deterministic (point masses).
    probs: np.ndarray | None = None


class DraftProposer(Protocol):
    def propose(
        self,
        request_id: str,
        token_ids: np.ndarray,
        block_ids: Sequence[int],
        num_tokens: int,
        sampling: DraftSampling,
    ) -> DraftProposal:
        """`num_tokens` proposed tokens after `token_ids` (the request's whole sequence, 1-D int).

        `block_ids` is the request's block list in the target's cache, already covering the
        sequence plus the proposals (a draft writing into a paged cache of the same blocks uses
        the target's slots for these positions)."""
        ...

    def forget(self, request_ids: Collection[str]) -> None:
        """Requests whose blocks went back to the pool (finished or preempted): what the draft
        wrote for them is no longer theirs."""
        ...
