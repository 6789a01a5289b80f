"""A request's life inside the engine core: its tokens, progress and status.

`Request` is mutable state owned by the scheduler alone; other stages see only the frozen
records the scheduler emits (`SchedulerOutput`) and the ones they return (`ModelRunnerOutput`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from compiled_engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token, or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose k/v are in the cache. Reset to 0 when the request is preempted (recompute).
    num_computed_tokens: int = 0
    # Scheduled in steps not yet updated: their tokens are being computed, and each of those steps
    # that samples for the request owes it one output token not known on the host yet.
    num_in_flight_tokens: int = 0
    num_pending_outputs: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prefix caching: requests with different salts never share cached blocks (None: no salt).
    cache_salt: str | None = None
    # Keys of the full blocks of the known tokens, filled in by the KV cache manager as tokens
    # arrive (core/kv_cache_manager.py); they stay valid across preemption.
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the cache must eventually hold."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
