"""What `Scheduler.update` reports per request after a step: new tokens and whether it ended."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" once finished, else None
    stop_reason: int | str | None = None  # the stop token that ended it, if any
