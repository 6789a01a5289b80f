"""The record the scheduler hands the model runner each step."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from compiled_engine.sampling_params import SamplingParams

# Stands for a token the previous step samples on the device and the host does not know yet
# (async loop): the runner feeds that step's sampled token in its place.
PLACEHOLDER_TOKEN_ID = -1


class ScheduledRequest(NamedTuple):
    request_id: str
    # Tokens fed this step: a chunk of the prompt (or of prompt+outputs after a preemption),
    # or the one token sampled last step (PLACEHOLDER_TOKEN_ID while that step is in flight).
    token_ids: tuple[int, ...]
    # Position of token_ids[0] in the sequence == tokens already in the KV cache.
    start_position: int
    # Every block the request owns, in order; covers start_position + len(token_ids) tokens.
    block_ids: tuple[int, ...]
    # True when this step reaches the end of the known tokens, so a new token is sampled.
    sample: bool
    sampling_params: SamplingParams
    # How many tokens the request has generated before this step (seeded sampling uses it).
    num_output_tokens: int
    # Structured outputs: the tokens its grammar allows next, packed (structured_output/); None
    # when the row is unconstrained or does not sample.
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: the last this many of token_ids are proposed tokens, not known ones;
    # the step verifies them (docs/speculative_decoding.md). 0: a plain step.
    num_draft_tokens: int = 0
    # Structured outputs with proposals: the grammar's mask before each proposed token (one per
    # proposal; grammar_bitmask is the one after them, the sampling row's). None: unconstrained.
    proposal_bitmasks: tuple[np.ndarray | None, ...] | None = None
    # Speculative decoding with a draft model that samples its proposals: the distribution q each
    # was drawn from [num_draft_tokens, vocab] (float32), for the verifier's min(1, p/q) rule.
    # None: deterministic proposals (n-gram, or the draft's argmax), point masses.
    draft_probs: np.ndarray | None = None
    # Multi-step scheduling (SchedulerConfig.num_scheduler_steps): the decode steps this row runs
    # back to back, each fed the token the step before sampled; block_ids cover all of them. Every
    # row of a step has the same count. 1: a plain step.
    num_steps: int = 1


class SchedulerOutput(NamedTuple):
    scheduled: tuple[ScheduledRequest, ...]
    # The tokens of every row (the sum of their token_ids' lengths): staging reads it as such.
    num_batched_tokens: int
    # Requests that left the running set since the last step: the runner drops per-request
    # state for finished ones; preempted ones keep their sampler state (they resume).
    preempted_request_ids: tuple[str, ...]
    finished_request_ids: tuple[str, ...]
    # Empty step because a request needs blocks that only preemption could give, and preempting
    # must wait until no step in flight reads the victim's blocks: update the in-flight steps,
    # then schedule again.
    waiting_for_in_flight: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
