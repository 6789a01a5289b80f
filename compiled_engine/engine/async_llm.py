"""`AsyncLLM`: the engine behind an asyncio front end (vLLM's AsyncLLM shape).

Threading model. One dedicated engine thread owns the `LLMEngine`: after construction nothing else
calls it. Coroutines on the event loop talk to that thread through a command inbox (add, abort,
shutdown); the thread sleeps on the inbox while no request is unfinished, otherwise it applies the
commands that arrived and runs one `step()`. Each step's outputs go back to the event loop in one
`loop.call_soon_threadsafe` callback, which hands each output to its request's `RequestStream`.
The event loop therefore never waits for a step, and every request in flight shares the
continuous batch.

The engine reports deltas (`SamplingParams.output_kind` DELTA: each output only this step's
tokens and text), so no step copies a request's whole output. A `RequestStream` appends them to
its completions rather than queueing them: a slow consumer simply sees fewer, larger updates,
and its memory does not grow with every step it missed. What a consumer asks for is built from
that record on demand: deltas against what it was last given, the cumulative output, or only
the final one.

Failure model. A request the engine refuses (bad prompt, too long) fails alone, at
`add_request`. Any exception inside `step()` is fatal: which request caused it is unknown, so the
thread stops and every waiter, now and later, gets `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.stats import EngineStats
from compiled_engine.engine_args import EngineArgs
from compiled_engine.errors import InvalidRequestError
from compiled_engine.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from compiled_engine.records.graph_status import GraphStatus
from compiled_engine.records.output_delta import CompletionDelta, RequestDelta
from compiled_engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["AsyncLLM", "EngineClosedError", "EngineDeadError", "RequestOutputKind", "RequestStream"]

logger = logging.getLogger(__name__)
# One line per finished request (key=value), on its own logger so a server can turn it on alone.
request_logger = logging.getLogger("compiled_engine.requests")


class EngineClosedError(RuntimeError):
    """The engine was shut down: it takes no new requests and ended the ones still running."""


class EngineDeadError(EngineClosedError):
    """The engine thread failed; no request can be served any more (the cause is chained)."""


@dataclass(frozen=True)
class FinishedRequestStats:
    """What the per-request log line and the server's metrics record when a request ends."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int  # over all completions of the request
    ttft_s: float | None  # None: ended (aborted) before its first token
    total_s: float
    finish_reason: str  # the first completion's reason; "abort" when aborted

    def log_line(self) -> str:
        ttft = "none" if self.ttft_s is None else f"{self.ttft_s:.4f}"
        return (
            f"request_id={self.request_id} prompt_tokens={self.num_prompt_tokens} "
            f"output_tokens={self.num_output_tokens} ttft_s={ttft} total_s={self.total_s:.4f} "
            f"finish_reason={self.finish_reason}"
        )


class RequestStatsListener(Protocol):
    """Told about token timing on the engine thread (implementations must be thread-safe)."""

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None: ...

    def on_new_tokens(self, num_tokens: int, inter_token_s: float | None) -> None: ...

    def on_finished(self, stats: FinishedRequestStats) -> None: ...


# -- the event-loop side of one request ---------------------------------------------------------------


@dataclass
class _Completion:
    """One completion of a request: everything the engine reported for it so far."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None  # one dict per token, when logprobs were asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    def add(self, delta: CompletionOutput | CompletionDelta) -> None:
        if delta.text:
            self.text_parts.append(delta.text)
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.cumulative_logprob = delta.cumulative_logprob

    def output(self, since: tuple[int, int] = (0, 0)) -> CompletionOutput:
        """As a CompletionOutput: all of it, or what came after `since` (text parts, tokens)."""
        parts, tokens = since
        if len(self.text_parts) > 1 and parts == 0:
            self.text_parts[:] = ["".join(self.text_parts)]  # joined once, not at every read
        return CompletionOutput(
            index=self.index,
            text="".join(self.text_parts[parts:]),
            token_ids=tuple(self.token_ids[tokens:]),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else self.logprobs[tokens:],
            cumulative_logprob=self.cumulative_logprob,
        )


class RequestStream:
    """Outputs of one request, as the event loop sees them. Iterate it once (`outputs()`)."""

    def __init__(
        self,
        request_id: str,
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[str], None],
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self._num_completions = params.n
        self._abort = abort
        self.accepted: asyncio.Future[None] = loop.create_future()
        self._changed = asyncio.Event()
        self._completions: dict[int, _Completion] = {}  # by index, as the engine reported them
        self._prompt_logprobs: PromptLogprobs | None = None
        self._prompt: tuple[str | None, tuple[int, ...]] = (None, ())
        self._error: BaseException | None = None
        self.finished = False

    # Called on the event loop (via call_soon_threadsafe from the engine thread).
    def _accept(self, prompt: str | None, prompt_token_ids: tuple[int, ...]) -> None:
        self._prompt = (prompt, prompt_token_ids)
        if not self.accepted.done():
            self.accepted.set_result(None)

    def _put(self, delta: RequestOutput | RequestDelta) -> None:
        """Add one engine output: what is new for the completions it carries (its prompt is the
        one `_accept` got, which always comes first)."""
        if self.finished:
            return  # e.g. an output that was on its way when the request was aborted
        for completion in delta.outputs:
            record = self._completions.get(completion.index)
            if record is None:
                record = self._completions[completion.index] = _Completion(completion.index)
            record.add(completion)
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        self.finished = delta.finished
        self._changed.set()

    def _fail(self, error: BaseException) -> None:
        if self.finished:
            return
        self.finished = True
        self._error = error
        if not self.accepted.done():
            self.accepted.set_exception(error)
            # Nobody may ever await it (the caller was cancelled): do not warn about that.
            self.accepted.exception()
        self._changed.set()

    def _finish_aborted(self) -> None:
        if self.finished:
            return
        self.finished = True
        for index in range(self._num_completions):
            record = self._completions.setdefault(index, _Completion(index))
            if record.finish_reason is None:
                record.finish_reason = "abort"
        if not self.accepted.done():
            self.accepted.set_result(None)
        self._changed.set()

    def _output(self, completions: tuple[CompletionOutput, ...]) -> RequestOutput:
        prompt, prompt_token_ids = self._prompt
        return RequestOutput(
            request_id=self.request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            prompt_logprobs=self._prompt_logprobs,
        )

    async def outputs(
        self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield outputs until the request finishes. Leaving early (break, cancel) aborts it."""
        sent: dict[int, tuple[int, int, bool]] = {}  # index -> (text parts, tokens, finished) given out
        try:
            while True:
                await self._changed.wait()
                self._changed.clear()
                if self._error is not None:
                    raise self._error
                if not self._completions and not self.finished:
                    continue
                finished = self.finished  # as of this output: it may change while the reader holds it
                if output_kind is RequestOutputKind.FINAL_ONLY and not finished:
                    continue
                if output_kind is RequestOutputKind.DELTA:
                    delta = self._delta(sent)
                    if delta.outputs or delta.finished:
                        yield delta
                else:
                    completions = self._completions
                    yield self._output(tuple(completions[i].output() for i in sorted(completions)))
                if finished:
                    return
        finally:
            if not self.finished:
                self._abort(self.request_id)

    def _delta(self, sent: dict[int, tuple[int, int, bool]]) -> RequestOutput:
        """What was not given out yet, by completion; updates `sent`."""
        changed = []
        for index in sorted(self._completions):
            record = self._completions[index]
            parts, tokens, was_finished = sent.get(index, (0, 0, False))
            now_finished = record.finish_reason is not None
            if (
                len(record.text_parts) == parts
                and len(record.token_ids) == tokens
                and now_finished == was_finished
            ):
                continue
            # Text parts are never joined while a delta reader reads them (only at parts == 0, by
            # a cumulative read), so its offsets stay valid.
            changed.append(record.output((parts, tokens)))
            sent[index] = (len(record.text_parts), len(record.token_ids), now_finished)
        return self._output(tuple(changed))

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self.outputs()


# -- engine-thread side ---------------------------------------------------------------------------------


@dataclass
class _Add:
    stream: RequestStream
    prompt: Any
    params: SamplingParams
    arrival: float


@dataclass
class _Abort:
    request_id: str


class _Shutdown:
    pass


@dataclass
class _LiveRequest:
    """Engine-thread bookkeeping for one accepted request: timing and token counts."""

    stream: RequestStream
    arrival: float
    num_prompt_tokens: int
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens_by_index: dict[int, int] = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.tokens_by_index.values())


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        log_requests: bool = True,
        stats_listeners: Sequence[RequestStatsListener] = (),
    ) -> None:
        """Take over `engine` (build it first, e.g. `LLM(...).engine`); from here on only the engine
        thread uses it. `log_requests` writes one key=value line per finished request to the
        `compiled_engine.requests` logger (INFO)."""
        self._engine = engine
        self._set_up(engine.stats(), log_requests, stats_listeners)
        self._thread = threading.Thread(target=self._run, name="compiled-engine-loop", daemon=True)
        self._thread.start()

    def _set_up(
        self, stats: EngineStats, log_requests: bool, stats_listeners: Sequence[RequestStatsListener]
    ) -> None:
        """The state both sides share; the caller then starts the thread that owns `_live`."""
        self._log_requests = log_requests
        self._listeners: list[RequestStatsListener] = list(stats_listeners)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Guards the registry and the closed/dead state, shared by the loop and the engine thread.
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}  # unfinished requests, by id
        self._closed = False
        self._dead_cause: BaseException | None = None
        self._live: dict[str, _LiveRequest] = {}  # engine thread only
        self._stats: EngineStats = stats

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, log_requests: bool = True) -> AsyncLLM:
        """Build an LLMEngine from `args` and wrap it."""
        return cls(LLMEngine(args), log_requests=log_requests)

    # -- facts about the engine, safe from any thread ----------------------------------------------------

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.config.max_model_len

    @property
    def model_dir(self) -> str:
        return self._engine.config.model_dir

    @property
    def errored(self) -> bool:
        return self._dead_cause is not None

    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (or the moment it went idle)."""
        return self._stats

    def graph_status(self) -> GraphStatus:
        """How many compiled graphs are ready, compiling, failed — now, even while the engine is
        idle (the background compiler reports on its own thread; this reads its snapshot)."""
        return self._engine.model_runner.step_graph.status()

    def add_stats_listener(self, listener: RequestStatsListener) -> None:
        self._listeners.append(listener)

    def replicas(self) -> Sequence[AsyncLLM | None]:
        """The engines behind this one: itself (engine/data_parallel.py has several)."""
        return (self,)

    # -- requests ---------------------------------------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt, sampling_params: SamplingParams | None = None
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it. A prompt the engine refuses raises
        InvalidRequestError here, and nothing else is affected."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r}")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"request {request_id}: sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        stream = RequestStream(request_id, params, asyncio.get_running_loop(), self.abort_nowait)
        if params.output_kind is not RequestOutputKind.DELTA:
            # The stream rebuilds whatever its reader asks for from the engine's deltas.
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        with self._lock:
            self._check_open()
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._submit(_Add(stream, prompt, params, time.monotonic()))
        try:
            await asyncio.shield(stream.accepted)
        except asyncio.CancelledError:
            self.abort_nowait(request_id)
            raise
        return stream

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs (cumulative by default). Stopping the iteration early, or
        cancelling the task iterating, aborts the request and frees its KV blocks."""
        stream = await self.add_request(request_id or uuid.uuid4().hex, prompt, sampling_params)
        outputs = stream.outputs(output_kind)
        try:
            async for output in outputs:
                yield output
        finally:
            # Close the stream now, not when it is garbage-collected, so an early exit aborts at once.
            await outputs.aclose()

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish_reason "abort"; unknown ids are ignored."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """`abort` without awaiting, for code that cannot (a `finally`, a response's close hook)."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return  # finished, failed or never known
            if not self._closed:
                self._submit(_Abort(request_id))
        _call_soon(stream.loop, stream._finish_aborted)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread: requests still running end with EngineClosedError, steps in
        flight are collected (their blocks return to the pool). Idempotent."""
        with self._lock:
            first = not self._closed
            self._closed = True
        if first:
            self._submit(_Shutdown())
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _submit(self, command: _Add | _Abort | _Shutdown) -> None:
        """Hand a command to the engine's side (here: the engine thread's inbox)."""
        self._inbox.put(command)

    def _check_open(self) -> None:
        if self._dead_cause is not None:
            raise _dead_error(self._dead_cause)
        if self._closed:
            raise EngineClosedError("the engine has been shut down")

    # -- the engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        try:
            while True:
                for command in self._take_commands(block=not engine.has_unfinished_requests()):
                    if isinstance(command, _Shutdown):
                        self._close_on_engine_thread()
                        return
                    if isinstance(command, _Add):
                        self._apply_add(command)
                    else:
                        self._apply_abort(command)
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                self._stats = engine.stats()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiters
            self._die(exc)

    def _take_commands(self, block: bool) -> list:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply_add(self, command: _Add) -> None:
        stream, engine = command.stream, self._engine
        with self._lock:
            if self._streams.get(stream.request_id) is not stream:
                return  # aborted before the engine thread saw it
        try:
            processed = engine.input_processor.process(command.prompt, command.params, stream.request_id)
            engine.add_request(stream.request_id, processed, command.params)
        except (ValueError, TypeError) as exc:
            # A problem with this request alone (InvalidRequestError is a ValueError).
            with self._lock:
                self._streams.pop(stream.request_id, None)
            _call_soon(stream.loop, stream._fail, exc)
            return
        self._live[stream.request_id] = _LiveRequest(
            stream, command.arrival, num_prompt_tokens=len(processed.prompt_token_ids)
        )
        _call_soon(stream.loop, stream._accept, processed.prompt, processed.prompt_token_ids)

    def _apply_abort(self, command: _Abort) -> None:
        live = self._live.pop(command.request_id, None)
        if live is None:
            return
        self._engine.abort_request([command.request_id])
        self._record_finished(command.request_id, live, "abort")

    def _deliver(self, outputs: Sequence[RequestOutput] | Sequence[RequestDelta]) -> None:
        """A step's outputs (deltas: the engine's output kind) to their streams' event loops."""
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | RequestDelta]]] = (
            defaultdict(list)
        )
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue  # aborted after the step started
            self._record_tokens(live, output, now)
            if output.finished:
                del self._live[output.request_id]
                with self._lock:
                    self._streams.pop(output.request_id, None)
                reason = output.outputs[0].finish_reason if output.outputs else None
                self._record_finished(output.request_id, live, reason or "stop")
            by_loop[live.stream.loop].append((live.stream, output))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _record_tokens(self, live: _LiveRequest, output: RequestOutput | RequestDelta, now: float) -> None:
        new = 0
        for completion in output.outputs:  # deltas (the engine's output kind)
            new += len(completion.token_ids)
            live.tokens_by_index[completion.index] = live.tokens_by_index.get(completion.index, 0) + len(
                completion.token_ids
            )
        if new <= 0:
            return
        since_last = None if live.last_token_at is None else now - live.last_token_at
        if live.first_token_at is None:
            live.first_token_at = now
            self._notify("on_first_token", now - live.arrival, live.num_prompt_tokens)
        live.last_token_at = now
        self._notify("on_new_tokens", new, since_last)

    def _record_finished(self, request_id: str, live: _LiveRequest, finish_reason: str) -> None:
        stats = FinishedRequestStats(
            request_id=request_id,
            num_prompt_tokens=live.num_prompt_tokens,
            num_output_tokens=live.num_output_tokens,
            ttft_s=None if live.first_token_at is None else live.first_token_at - live.arrival,
            total_s=time.monotonic() - live.arrival,
            finish_reason=finish_reason,
        )
        if self._log_requests:
            request_logger.info(stats.log_line())
        self._notify("on_finished", stats)

    def _notify(self, method: str, *args) -> None:
        for listener in self._listeners:
            try:
                getattr(listener, method)(*args)
            except Exception:
                # Metrics must never take serving down; the traceback still reaches the log.
                logger.exception("stats listener %r failed in %s", listener, method)

    def _close_on_engine_thread(self) -> None:
        """Shutdown: end what is still running, collect steps in flight, report final stats."""
        ids = list(self._live)
        if ids:
            self._engine.abort_request(ids)
            for request_id in ids:
                self._record_finished(request_id, self._live.pop(request_id), "abort")
        self._engine.drain()
        self._stats = self._engine.stats()
        self._fail_all(lambda: EngineClosedError("the engine was shut down while the request ran"))

    def _die(self, cause: BaseException) -> None:
        logger.error("engine loop failed; no request can be served any more", exc_info=cause)
        with self._lock:
            self._dead_cause = cause
            self._closed = True
        self._fail_all(lambda: _dead_error(cause))

    def _fail_all(self, make_error: Callable[[], BaseException]) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        self._live.clear()
        for stream in streams:
            _call_soon(stream.loop, stream._fail, make_error())


def _dead_error(cause: BaseException) -> EngineDeadError:
    error = EngineDeadError(f"the engine loop failed: {cause!r}")
    error.__cause__ = cause
    return error


def _put_all(items: list[tuple[RequestStream, RequestOutput | RequestDelta]]) -> None:
    for stream, output in items:
        stream._put(output)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass  # the loop is closed: nobody is left to tell
