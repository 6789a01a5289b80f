"""A request's life inside the engine core: its tokens, progress and status.

`Request` is mutable state owned by the scheduler alone; other stages see only the frozen
records the scheduler emits (`SchedulerOutput`) and the ones they return (`ModelRunnerOutput`),
and, read-only, the request's `TokenHistory`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from compiled_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from compiled_engine.structured_output.request_grammar import RequestGrammar


class TokenHistory:
    """A request's tokens, kept once: its prompt, then every output the scheduler accepted.

    Created with the request and appended only by its owner, the scheduler (`append`, at update);
    the runner's staging (penalties, min_tokens, prompt logprobs) and the output processor hold
    the same object and read it, never copy it. With a step in flight, the outputs lack the token
    that step is still sampling (the async loop feeds it as a placeholder on the device).

    A pickled copy is a replica: a tensor-parallel worker receives one with the runner's
    add_request (workers are other processes, so they need their own) and keeps it current with
    `extend_replica`, called through the runner's record_outputs; only a replica takes that, and
    only the owner takes `append`.
    """

    __slots__ = (
        "prompt_token_ids",
        "_output_token_ids",
        "_prompt_array",
        "is_replica",
        "num_tokens",
        "newest_token_id",
        "num_prompt_tokens",
    )

    def __init__(self, prompt_token_ids: Sequence[int]) -> None:
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)  # a tuple is not copied
        self._output_token_ids: list[int] = []
        self._prompt_array: np.ndarray | None = None
        self.is_replica = False
        # Prompt plus outputs, the last of them, and the prompt's length, kept with them (read for
        # every running request every step: the scheduler's decode row feeds the newest token and
        # counts the outputs).
        self.num_tokens = self.num_prompt_tokens = len(self.prompt_token_ids)
        self.newest_token_id = self.prompt_token_ids[-1] if self.prompt_token_ids else -1

    @property
    def output_token_ids(self) -> Sequence[int]:
        """The accepted outputs, live (not a copy): read it, never write it."""
        return self._output_token_ids

    @property
    def prompt_array(self) -> np.ndarray:
        """The prompt as a read-only int64 array (built once, for the runner's numpy staging)."""
        if self._prompt_array is None:
            array = np.asarray(self.prompt_token_ids, dtype=np.int64)
            array.flags.writeable = False
            self._prompt_array = array
        return self._prompt_array

    def append(self, token_id: int) -> None:
        """An output the scheduler accepted (its update); the owner's history only."""
        if self.is_replica:
            raise RuntimeError("a replica history follows its owner through extend_replica, never append")
        self._output_token_ids.append(token_id)
        self.num_tokens += 1
        self.newest_token_id = token_id

    def extend_replica(self, token_ids: Sequence[int]) -> None:
        """Outputs the owner accepted, copied into this replica (a tensor-parallel worker's)."""
        if not self.is_replica:
            raise RuntimeError("only a replica is extended; the owner's history is appended by the scheduler")
        self._output_token_ids.extend(token_ids)
        self.num_tokens = len(self.prompt_token_ids) + len(self._output_token_ids)
        self._set_newest()

    def __eq__(self, other: object) -> bool:
        """Same tokens (a replica equals its owner once it has caught up)."""
        if not isinstance(other, TokenHistory):
            return NotImplemented
        return (
            self.prompt_token_ids == other.prompt_token_ids
            and self._output_token_ids == other._output_token_ids
        )

    __hash__ = None  # type: ignore[assignment]  # mutable: appended as outputs arrive

    def __getstate__(self) -> tuple[tuple[int, ...], list[int]]:
        return self.prompt_token_ids, self._output_token_ids

    def __setstate__(self, state: tuple[tuple[int, ...], list[int]]) -> None:
        self.prompt_token_ids, outputs = state
        self._output_token_ids = list(outputs)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens + len(self._output_token_ids)
        self._set_newest()
        self._prompt_array = None
        self.is_replica = True

    def _set_newest(self) -> None:
        outputs, prompt = self._output_token_ids, self.prompt_token_ids
        self.newest_token_id = outputs[-1] if outputs else (prompt[-1] if prompt else -1)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token, or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


FINISHED_STATUSES = frozenset(
    (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
)


@dataclass(eq=False)
class Request:
    request_id: str
    # Given at creation; kept in `history`, and afterwards the same tuple as its prompt.
    prompt_token_ids: Sequence[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # Tokens whose k/v are in the cache. Reset to 0 when the request is preempted (recompute).
    num_computed_tokens: int = 0
    # Scheduled in steps not yet updated: their tokens are being computed, and each of those steps
    # that samples for the request owes it one output token not known on the host yet.
    num_in_flight_tokens: int = 0
    num_pending_outputs: int = 0
    # Speculative decoding: a step in flight verifies proposals for it, so how many tokens it
    # will have (and where its cache ends) is unknown until that step is updated.
    has_proposals_in_flight: bool = False
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prefix caching: requests with different salts never share cached blocks (None: no salt).
    cache_salt: str | None = None
    # Keys of the full blocks of the known tokens, filled in by the KV cache manager as tokens
    # arrive (core/kv_cache_manager.py); they stay valid across preemption.
    block_hashes: list[bytes] = field(default_factory=list)
    # Structured outputs: the request's matcher over its compiled grammar (None: unconstrained).
    # The scheduler admits it once the grammar is compiled and asks it for each sampling step's mask.
    grammar: RequestGrammar | None = field(default=None, repr=False)
    # The request's tokens (prompt, accepted outputs): the one record of them, shared read-only
    # with the runner and the output processor; the scheduler appends to it at update.
    history: TokenHistory = field(init=False, repr=False)
    # For the scheduler's check of every sampled token: the ids that end it (stop tokens, and
    # EOS unless ignored) and the length that ends it (prompt + max_tokens).
    stopping_token_ids: frozenset[int] = field(init=False, repr=False)
    max_num_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.history = TokenHistory(self.prompt_token_ids)
        self.prompt_token_ids = self.history.prompt_token_ids
        params = self.sampling_params
        self.stopping_token_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
        )
        self.max_num_tokens = len(self.prompt_token_ids) + params.max_tokens

    @property
    def output_token_ids(self) -> Sequence[int]:
        """Outputs accepted so far (the history's, live)."""
        return self.history.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the cache must eventually hold."""
        return self.history.num_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.history.output_token_ids]
