"""What `Scheduler.update` reports per request after a step: new tokens and whether it ended."""

from __future__ import annotations

from typing import NamedTuple

from compiled_engine.records.runner_output import TokenLogprobs


class EngineCoreOutput(NamedTuple):
    """Immutable; a NamedTuple because one is built per request every step (a frozen dataclass
    costs several times as much to construct)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" once finished, else None
    stop_reason: int | str | None = None  # the stop token that ended it, if any
    # Attached by the engine core after the update: one per new token, when logprobs were asked.
    new_logprobs: tuple[TokenLogprobs, ...] | None = None
    # With the first token of a request that asked for prompt_logprobs: one per prompt token,
    # None for the first (nothing predicts it).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
