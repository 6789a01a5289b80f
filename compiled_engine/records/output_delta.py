"""A step's outputs as the engine process sends them to the API server: what changed, as tuples.

The server's engine asks for DELTA outputs, and the server already holds each request's prompt
(the `Accepted` message), so a step's `RequestOutput`s go over the pipe without their prompt and
prompt token ids, as plain tuples. Pickling tuples of strings and ints runs in C; a frozen
dataclass goes through `__reduce_ex__` in Python, and each output carried its whole prompt, every
step: at 256 streams of 32-token prompts a step's outputs cost ~0.4 ms to pickle and ~0.55 ms
to unpickle, ~3 and ~5 ms at 1,000-token prompts, against ~0.05 ms each way as tuples
(docs/performance.md, "Session 11").

The reader turns each tuple back into a `RequestDelta` (a NamedTuple with the `RequestOutput`
fields the stream reads), built in C by `tuple.__new__`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from compiled_engine.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs


class CompletionDelta(NamedTuple):
    """A `CompletionOutput`'s fields, in its order: one sample's text and tokens of this step."""

    index: int  # type: ignore[assignment]  # CompletionOutput's name; shadows tuple.index, unused here
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None


class RequestDelta(NamedTuple):
    """A `RequestOutput` without its prompt: the request's id, and what its samples got this step."""

    request_id: str
    finished: bool
    prompt_logprobs: PromptLogprobs | None
    outputs: tuple[CompletionDelta, ...]


# What goes over the pipe: a RequestDelta's fields, its completions as CompletionDelta's.
WireOutput = tuple[str, bool, PromptLogprobs | None, tuple[tuple, ...]]


def _completion_fields(c: CompletionOutput) -> tuple:
    return (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)


def to_wire(outputs: Sequence[RequestOutput]) -> list[WireOutput]:
    """The step's outputs as plain tuples (their prompts left out)."""
    return [
        (o.request_id, o.finished, o.prompt_logprobs, tuple(map(_completion_fields, o.outputs)))
        for o in outputs
    ]


def from_wire(items: Sequence[WireOutput]) -> list[RequestDelta]:
    new = tuple.__new__
    return [
        new(RequestDelta, (request_id, finished, logprobs, tuple(new(CompletionDelta, c) for c in samples)))
        for request_id, finished, logprobs, samples in items
    ]
