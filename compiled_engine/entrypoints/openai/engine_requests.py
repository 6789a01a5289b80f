"""The engine requests behind one HTTP request, and engine errors as HTTP errors.

One HTTP request may need several engine requests (a completions call with a list of prompts:
one per prompt; `n` stays inside one engine request). They are added together — if one is
refused, the ones already added are aborted — and read together, as final outputs or as deltas.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from http import HTTPStatus

from compiled_engine.engine.async_llm import (
    AsyncLLM,
    EngineClosedError,
    EngineDeadError,
    RequestOutputKind,
    RequestStream,
)
from compiled_engine.entrypoints.openai.errors import OpenAIError, bad_request
from compiled_engine.entrypoints.openai.streaming import merge_async_iterators
from compiled_engine.errors import InvalidRequestError
from compiled_engine.outputs import RequestOutput
from compiled_engine.sampling_params import SamplingParams


def engine_error(exc: Exception) -> OpenAIError:
    """What the client is told about an engine exception."""
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError):
        return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), type="engine_dead_error")
    if isinstance(exc, EngineClosedError):
        return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), type="service_unavailable")
    raise TypeError(f"not an engine error: {exc!r}")


ENGINE_ERRORS = (InvalidRequestError, EngineClosedError)


class EngineRequests:
    def __init__(self, engine: AsyncLLM, streams: list[RequestStream]) -> None:
        self._engine = engine
        self.streams = streams

    @classmethod
    async def start(
        cls,
        engine: AsyncLLM,
        request_id: str,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
    ) -> EngineRequests:
        """Add one engine request per prompt (ids `request_id`, or `request_id-i` for several)."""
        streams: list[RequestStream] = []
        try:
            for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await engine.add_request(rid, {"prompt_token_ids": prompt}, sampling))
        except BaseException as exc:
            for stream in streams:
                engine.abort_nowait(stream.request_id)
            if isinstance(exc, ENGINE_ERRORS):
                raise engine_error(exc) from exc
            raise
        return cls(engine, streams)

    def abort_unfinished(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                self._engine.abort_nowait(stream.request_id)

    async def finals(self) -> list[RequestOutput]:
        """Each request's final output, in prompt order."""

        async def final(stream: RequestStream) -> RequestOutput:
            async for output in stream.outputs(RequestOutputKind.FINAL_ONLY):
                return output
            raise AssertionError("a request stream ended without a final output")

        try:
            return list(await asyncio.gather(*(final(s) for s in self.streams)))
        except ENGINE_ERRORS as exc:
            raise engine_error(exc) from exc
        finally:
            self.abort_unfinished()

    def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, what is new) as it comes, from every request."""
        return merge_async_iterators([s.outputs(RequestOutputKind.DELTA) for s in self.streams])
