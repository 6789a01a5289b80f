"""Draft-model proposals from the draft's own tight loop (worker/draft_decoder.py).

Per request the proposer holds a slot of the decoder's contiguous KV buffer and remembers the
tokens whose k/v the slot holds. Asked for proposals, it keeps the longest prefix still equal to
the request's tokens (after a partial acceptance the rejected proposals' positions differ),
prefills what is missing short of the last two tokens (the whole prompt the first time; usually
nothing later), and makes one compiled call that feeds those two and runs k one-token steps.

Slots are few (the requests that speculate at once) and reused least-recently-used first: a
request whose slot went to another starts over, and a finished or preempted one's is freed
(`forget`). What the draft proposes only changes how fast a request runs, never its tokens.

Proposals for a greedy (or constrained) request are the draft's argmax; for a sampled one they
are drawn from q = softmax(draft logits / temperature), and q goes with them to the verifier
(min(1, p/q), worker/spec_verifier.py). A seeded request's draws come from a generator derived
from its seed and progress, so its output stays a function of its seed alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

import numpy as np
import torch

from compiled_engine.records.draft_proposer import GREEDY_DRAFT, DraftProposal, DraftSampling
from compiled_engine.worker.draft_decoder import DraftDecoder

# A seeded request's draft draws use a stream of their own (not its sampling or acceptance ones).
_DRAFT_STREAM = 0x5EED_D4AF


class DraftLoopProposer:
    def __init__(self, decoder: DraftDecoder, num_slots: int, max_chunk: int, seed: int) -> None:
        self.decoder = decoder
        self._max_chunk = max_chunk  # longer catch-ups are prefilled in chunks of this many tokens
        self._free = list(range(num_slots))
        self._slots: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._written: dict[str, np.ndarray] = {}  # the tokens whose k/v each request's slot holds
        self._generator = torch.Generator(device=decoder.device)
        self._generator.manual_seed(seed)
        self.num_steps = 0  # draft forwards run (prefill chunks and proposal calls), over its life

    def propose(
        self,
        request_id: str,
        token_ids: np.ndarray,
        block_ids: Sequence[int],
        num_tokens: int,
        sampling: DraftSampling = GREEDY_DRAFT,
    ) -> DraftProposal:
        k = self.decoder.num_proposals
        if not 1 <= num_tokens <= k:
            raise ValueError(f"asked for {num_tokens} proposals; the draft makes 1 to {k}")
        slot = self._slot_for(request_id)
        length = len(token_ids)
        # Everything up to the last two tokens must be in the slot; propose() feeds those two.
        end = max(length - 2, 0)
        start = min(self._valid_prefix(request_id, token_ids), end)
        while start < end:
            stop = min(start + self._max_chunk, end)
            self.decoder.prefill(slot, torch.from_numpy(np.ascontiguousarray(token_ids[start:stop])), start)
            self.num_steps += 1
            start = stop
        last_two = (int(token_ids[max(length - 2, 0)]), int(token_ids[length - 1]))
        sampled = sampling.temperature > 0
        noise = self._noise(sampling) if sampled else None
        proposals, probs = self.decoder.propose(slot, last_two, length - 1, sampling.temperature, noise)
        self.num_steps += 1
        # The call fed every proposal but the last: the slot holds their k/v too.
        self._written[request_id] = np.concatenate(
            (token_ids, np.asarray(proposals[:-1], dtype=token_ids.dtype))
        )
        chosen = tuple(proposals[:num_tokens])
        if probs is None:
            return DraftProposal(chosen)
        return DraftProposal(chosen, probs[:num_tokens].float().cpu().numpy())

    def forget(self, request_ids: Collection[str]) -> None:
        for request_id in request_ids:
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)
            self._written.pop(request_id, None)

    def close(self) -> None:
        self._slots.clear()
        self._written.clear()

    def _slot_for(self, request_id: str) -> int:
        slot = self._slots.get(request_id)
        if slot is not None:
            self._slots.move_to_end(request_id)
            return slot
        if not self._free:
            # Every slot is taken: the least recently used request loses its cache (it starts
            # over if it speculates again).
            evicted, slot = self._slots.popitem(last=False)
            self._written.pop(evicted, None)
        else:
            slot = self._free.pop()
        self._slots[request_id] = slot
        return slot

    def _valid_prefix(self, request_id: str, token_ids: np.ndarray) -> int:
        """How many of the request's first tokens the slot already holds k/v for."""
        written = self._written.get(request_id)
        if written is None:
            return 0
        n = min(len(written), len(token_ids))
        differ = np.flatnonzero(written[:n] != token_ids[:n])
        return int(differ[0]) if len(differ) else n

    def _noise(self, sampling: DraftSampling) -> torch.Tensor:
        """Exp(1) draws [1, k, vocab] for the exponential race that samples from q."""
        generator = self._generator
        if sampling.seed is not None:
            generator = torch.Generator(device=self.decoder.device)
            generator.manual_seed(
                ((sampling.seed * 1_000_003 + sampling.num_output_tokens) ^ _DRAFT_STREAM) % (1 << 63)
            )
        shape = (1, self.decoder.num_proposals, self.decoder.vocab_size)
        return torch.empty(shape, device=self.decoder.device).exponential_(generator=generator)
