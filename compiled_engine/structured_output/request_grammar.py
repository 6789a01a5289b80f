"""One request's position in its grammar, and the mask of the tokens allowed next.

The request's token history is the truth: before each mask the matcher catches up with the
outputs the scheduler accepted since the last one, and if the history is shorter than what the
matcher consumed (tokens taken back) it is rebuilt from the history. So preemption (the outputs
stay in the history and are replayed as prompt) and discarded tokens need no bookkeeping here.
Only the scheduler's thread touches it.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from concurrent.futures import Future

import numpy as np
import xgrammar as xgr

logger = logging.getLogger(__name__)


class RequestGrammar:
    def __init__(
        self, compiled: Future[xgr.CompiledGrammar], vocab_size: int, stop_token_ids: Collection[int]
    ) -> None:
        self._compiled = compiled
        self.vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._matcher: xgr.GrammarMatcher | None = None
        self._num_accepted = 0  # outputs the matcher consumed
        self._rejected = False  # an output the grammar does not allow arrived (see next_token_bitmask)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def is_ready(self) -> bool:
        """Whether the grammar is compiled (or failed to: next_token_bitmask then raises why)."""
        return self._compiled.done()

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for the grammar (when there is nothing else to do)."""
        try:
            self._compiled.exception(timeout=timeout)
        except TimeoutError:
            pass

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def next_token_bitmask(self, output_token_ids: Sequence[int]) -> np.ndarray | None:
        """The tokens allowed after `output_token_ids` (the request's whole output so far) as
        xgrammar's packed bitmask (int32 words, bit i of word j = token 32 j + i), or None when
        every token is allowed."""
        error = self._compiled.exception()
        if error is not None:
            # Parsing succeeded when the request was added, so this is xgrammar failing: end this
            # request at once (stop tokens only) rather than fail the step every request shares.
            if not self._rejected:
                logger.error("grammar compilation failed (%s); the request ends now", error)
                self._rejected = True
            return self._stop_tokens_only()
        matcher = self._catch_up(output_token_ids)
        if self._rejected:
            return None
        if matcher.is_terminated():
            # Complete, its stop token taken, and still asked (ignore_eos): only stop tokens fit.
            return self._stop_tokens_only()
        if not matcher.fill_next_token_bitmask(self._bitmask, 0):
            return None
        return self._bitmask[0].numpy().copy()

    def proposal_bitmasks(
        self, output_token_ids: Sequence[int], proposals: Sequence[int]
    ) -> list[np.ndarray | None]:
        """Speculative decoding: the masks of a run of proposed tokens after `output_token_ids`.

        Entry i is the mask before proposal i, for as many proposals in a row as the grammar
        allows; the last entry is the mask after them. So `len(result) - 1` proposals are kept:
        the first one the grammar forbids, and those after it, are dropped (the target could never
        take it). The matcher advances through the kept ones to fill the masks and is rolled back
        after: the request's history stays the truth (the accepted proposals come in with it).
        """
        first = self.next_token_bitmask(output_token_ids)
        matcher = self._matcher
        if matcher is None or self._rejected or matcher.is_terminated():
            return [first]
        masks = [first]
        advanced = 0
        for token_id in proposals:
            mask = masks[-1]
            if mask is not None and not (int(mask[token_id // 32]) >> (token_id % 32)) & 1:
                break
            if not matcher.accept_token(token_id):
                break
            advanced += 1
            if matcher.is_terminated():
                masks.append(self._stop_tokens_only())
                break
            masks.append(
                self._bitmask[0].numpy().copy() if matcher.fill_next_token_bitmask(self._bitmask, 0) else None
            )
        if advanced:
            matcher.rollback(advanced)
        return masks

    def _stop_tokens_only(self) -> np.ndarray:
        mask = np.zeros(self._bitmask.shape[1], dtype=np.uint32)
        for token_id in self._stop_token_ids:
            mask[token_id // 32] |= np.uint32(1 << (token_id % 32))
        return mask.view(np.int32)

    def _catch_up(self, output_token_ids: Sequence[int]) -> xgr.GrammarMatcher:
        if self._matcher is None or len(output_token_ids) < self._num_accepted:
            self._matcher = xgr.GrammarMatcher(self._compiled.result())
            self._num_accepted = 0
            self._rejected = False
        matcher = self._matcher
        for token_id in output_token_ids[self._num_accepted :]:
            if matcher.is_terminated() and token_id in self._stop_token_ids:
                continue  # more stop tokens after the end (ignore_eos): all the mask allowed
            if not self._rejected and not matcher.accept_token(token_id):
                # Only when something outside the mask forced the token (min_tokens banning the
                # only allowed stop token, say): the constraint cannot be kept any more.
                logger.warning("token %d is outside the request's grammar; constraint dropped", token_id)
                self._rejected = True
        self._num_accepted = len(output_token_ids)
        return matcher
