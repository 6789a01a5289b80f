"""Server-sent events, the response that aborts its requests when it ends early, and fan-in.

Disconnects: for a streaming response Starlette watches the connection and cancels the body
iterator when the client goes away (or the next write fails). `AbortingStreamingResponse` runs
`on_close` whenever the response ends — finished, cancelled or failed — and `on_close` aborts
whatever of the request is still running, so its KV blocks return to the pool at once. Putting it
on the response, not inside the body generator, also covers a disconnect before the generator
first runs (a generator that never started never runs its `finally`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from fastapi.responses import StreamingResponse

T = TypeVar("T")

DONE_EVENT = "data: [DONE]\n\n"


def sse_event(payload_json: str) -> str:
    return f"data: {payload_json}\n\n"


class AbortingStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            # Proxies (nginx) must pass events on as they come, not buffer the response.
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def merge_async_iterators(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several iterators as they arrive, tagged with the iterator's position. Leaving
    early (or an error in one) cancels and closes the rest, so their requests are aborted."""
    if len(iterators) == 1:  # the common case needs no task per item
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _close(iterators[0])
        return
    pending: dict[asyncio.Task, int] = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[index]))] = index
                yield index, item
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await _close(it)


async def _close(iterator: AsyncIterator) -> None:
    aclose = getattr(iterator, "aclose", None)  # async generators have it; plain iterators may not
    if aclose is not None:
        await aclose()
