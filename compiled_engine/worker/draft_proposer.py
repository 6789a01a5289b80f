"""Speculative decoding's `draft_model` method for drafts the tight loop cannot run (not
Llama-family: worker/draft_decoder.py `supports`; engine/draft_model.py picks).

The draft is a second `ModelRunner` — its own step graph (the target's compile route: buckets,
cache entry, CUDA graphs), its own paged KV cache — driven one request at a time with the
scheduler's records. Its cache has as many blocks as the target's, of the same size, and a
request's draft k/v live in the request's own target block ids: the scheduler's block pool
allocates both, lookahead included, and frees both when the request ends or is preempted
(records/draft_proposer.py is the protocol the scheduler calls).

Per request the proposer remembers what it wrote: the tokens at each position and the blocks they
went into. Asked again, it keeps the longest prefix whose tokens are still the request's (after a
partial acceptance, the rejected proposals' positions differ) and feeds the rest — usually one or
two tokens — before its k greedy decode steps; the slots of rejected proposals are overwritten
then. A request whose blocks went back to the pool is forgotten, so a resumed request starts over.

Proposals are the draft's argmax: a deterministic function of the request's tokens, which is what
the verifier's rejection sampling assumes (worker/spec_verifier.py: a point-mass proposal keeps the
target's distribution exactly).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from compiled_engine.records.draft_proposer import GREEDY_DRAFT, DraftProposal, DraftSampling
from compiled_engine.records.scheduler_output import ScheduledRequest, SchedulerOutput
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class _Written:
    """What the draft's cache holds for one request: k/v of `token_ids`, in `block_ids`."""

    token_ids: np.ndarray
    block_ids: tuple[int, ...]


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, max_num_batched_tokens: int) -> None:
        self.runner = runner
        self._max_chunk = max_num_batched_tokens  # the draft's step budget: longer catch-ups are chunked
        self._written: dict[str, _Written] = {}
        self.num_steps = 0  # draft steps run, over its life (tests, stats)

    def propose(
        self,
        request_id: str,
        token_ids: np.ndarray,
        block_ids: Sequence[int],
        num_tokens: int,
        sampling: DraftSampling = GREEDY_DRAFT,
    ) -> DraftProposal:
        """The draft's argmax proposals whatever `sampling` says: point masses (probs None)."""
        length = len(token_ids)
        blocks = tuple(block_ids)
        start = min(self._valid_prefix(request_id, token_ids, blocks), length - 1)
        # Catch up on what the draft has not seen (the whole prompt the first time), sampling its
        # first proposal from the last position.
        token = -1
        while start < length:
            chunk = token_ids[start : start + self._max_chunk]
            end = start + len(chunk)
            token = self._step(request_id, tuple(chunk.tolist()), start, blocks, sample=end == length)
            start = end
        proposals = [token]
        for position in range(length, length + num_tokens - 1):
            proposals.append(self._step(request_id, (proposals[-1],), position, blocks, sample=True))
        # The last proposal was sampled, never fed: its k/v are not in the cache.
        written = np.concatenate((token_ids, np.asarray(proposals[:-1], dtype=token_ids.dtype)))
        self._written[request_id] = _Written(written, blocks)
        return DraftProposal(tuple(proposals))

    def forget(self, request_ids: Collection[str]) -> None:
        for request_id in request_ids:
            self._written.pop(request_id, None)
        self.runner.remove_requests(request_ids)

    def close(self) -> None:
        self.runner.close()

    def _valid_prefix(self, request_id: str, token_ids: np.ndarray, blocks: tuple[int, ...]) -> int:
        """How many of the request's first tokens the draft's cache already holds."""
        written = self._written.get(request_id)
        if written is None:
            return 0
        if blocks[: len(written.block_ids)] != written.block_ids:
            # Not the blocks it wrote into (forget() was missed): start over on a fresh row.
            self.forget((request_id,))
            return 0
        n = min(len(written.token_ids), len(token_ids))
        differ = np.flatnonzero(written.token_ids[:n] != token_ids[:n])
        return int(differ[0]) if len(differ) else n

    def _step(
        self,
        request_id: str,
        token_ids: tuple[int, ...],
        start: int,
        blocks: tuple[int, ...],
        *,
        sample: bool,
    ) -> int:
        scheduled = ScheduledRequest(request_id, token_ids, start, blocks, sample, _GREEDY, 0)
        output = self.runner.execute(SchedulerOutput((scheduled,), len(token_ids), (), ()))
        self.num_steps += 1
        return output.sampled_token_ids[0] if sample else -1
