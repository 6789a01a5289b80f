"""`ProcessAsyncLLM`: `AsyncLLM` with its engine in a process of its own (engine/engine_process.py).

What `compiled-engine serve` runs. In-process, the engine thread's Python work (scheduling,
staging, output processing) shares one GIL with the event loop that parses requests and frames
every streamed token; here the two never wait on each other's interpreter. The event-loop side is
AsyncLLM's own (`RequestStream`, deltas, aborts, stats listeners); what changes is who applies the
commands and where outputs come from:

- a sender thread takes the commands AsyncLLM submits and sends them to the engine process in
  batches (the event loop never blocks on the socket);
- a reader thread receives the engine's updates and does what AsyncLLM's engine thread does after
  a step: registers accepted requests, fails refused ones, records aborts, hands outputs to their
  streams (`_deliver`), keeps the latest stats.

Failure model, as in-process: a refused request fails alone; an exception inside a step, or the
engine process dying (killed, out of memory), is fatal — every waiter, now and later, gets
`EngineDeadError` naming the cause, and /health turns 503. `shutdown()` ends the process (killed if
it does not leave in time); the engine process also leaves by itself when this process dies.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from compiled_engine.engine.async_llm import (
    AsyncLLM,
    EngineClosedError,
    RequestStatsListener,
    _Abort,
    _Add,
    _call_soon,
    _LiveRequest,
    _Shutdown,
)
from compiled_engine.engine.engine_process import (
    AbortRequests,
    AddRequest,
    EngineClosed,
    EngineFailed,
    EngineProcess,
    EngineProcessError,
    EngineUpdate,
    Shutdown,
)
from compiled_engine.engine_args import EngineArgs

if TYPE_CHECKING:
    from compiled_engine.engine.ray_engine import RayEngineHandle
from compiled_engine.records.graph_status import GraphStatus
from compiled_engine.records.output_delta import from_wire

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """A step raised inside the engine process (its traceback is in the message)."""


class ProcessAsyncLLM(AsyncLLM):
    def __init__(
        self,
        engine_process: EngineProcess | RayEngineHandle,
        *,
        log_requests: bool = True,
        stats_listeners: Sequence[RequestStatsListener] = (),
    ) -> None:
        """Take over a started engine process (use `ProcessAsyncLLM.start(args)`), or an engine
        in a Ray actor (engine/ray_engine.py): the same messages either way."""
        self._process = engine_process
        self._set_up(engine_process.ready.stats, log_requests, stats_listeners)
        self._outbox: queue.SimpleQueue[_Add | _Abort | _Shutdown | None] = queue.SimpleQueue()
        # Adds sent, not yet answered: the reader needs their stream and arrival time.
        self._pending: dict[str, _Add] = {}
        self._sender = threading.Thread(target=self._send_loop, name="compiled-engine-sender", daemon=True)
        self._thread = threading.Thread(target=self._read_loop, name="compiled-engine-reader", daemon=True)
        self._sender.start()
        self._thread.start()

    @classmethod
    def start(cls, args: EngineArgs, *, log_requests: bool = True) -> ProcessAsyncLLM:
        """Start an engine process on `args` and wrap it (a failure to build raises here)."""
        return cls(EngineProcess.start(args), log_requests=log_requests)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, log_requests: bool = True) -> ProcessAsyncLLM:
        return cls.start(args, log_requests=log_requests)

    # -- facts, from the engine's start-up report and its latest stats --------------------------------

    @property
    def tokenizer(self):
        return self._process.ready.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._process.ready.max_model_len

    @property
    def model_dir(self) -> str:
        return self._process.ready.model_dir

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._process.pid

    @property
    def node_id(self) -> str | None:
        """The Ray node the engine runs on (engine/ray_engine.py); None for a local process."""
        return getattr(self._process, "node_id", None)

    def graph_status(self) -> GraphStatus:
        # The engine reports graph changes while idle too (engine_process.IDLE_POLL_S).
        return self._stats.graphs

    def shutdown(self, timeout: float | None = 30.0) -> None:
        super().shutdown(timeout)
        self._outbox.put(None)  # the sender may still wait (the engine died first)
        self._process.close(30.0 if timeout is None else timeout)

    # -- sender thread ------------------------------------------------------------------------------------

    def _submit(self, command: _Add | _Abort | _Shutdown) -> None:
        self._outbox.put(command)

    def _send_loop(self) -> None:
        while True:
            commands = [self._outbox.get()]
            while True:
                try:
                    commands.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            messages: list = []
            last = False
            for command in commands:
                if command is None:
                    last = True
                elif isinstance(command, _Add):
                    self._pending[command.stream.request_id] = command
                    messages.append(AddRequest(command.stream.request_id, command.prompt, command.params))
                elif isinstance(command, _Abort):
                    messages.append(AbortRequests((command.request_id,)))
                else:
                    messages.append(Shutdown())
                    last = True
            try:
                if messages:
                    self._process.conn.send(messages)
            except OSError:
                return  # the engine is gone; the reader reports it
            if last:
                return

    # -- reader thread (owns `_live`, as the engine thread does in-process) ----------------------------------

    def _read_loop(self) -> None:
        conn = self._process.conn
        try:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    raise EngineProcessError(self._process.describe_exit()) from None
                if isinstance(message, EngineUpdate):
                    self._apply(message)
                elif isinstance(message, EngineClosed):
                    self._closed_by_engine(message)
                    return
                elif isinstance(message, EngineFailed):
                    error = EngineStepError(f"{message.error!r}\n{message.traceback}")
                    error.__cause__ = message.error
                    raise error
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiters
            self._die(exc)

    def _apply(self, update: EngineUpdate) -> None:
        for accepted in update.accepted:
            add = self._pending.pop(accepted.request_id, None)
            if add is None:
                continue
            stream = add.stream
            with self._lock:
                registered = self._streams.get(stream.request_id) is stream
            if not registered:
                continue  # aborted before the engine answered; the engine has the abort too
            self._live[stream.request_id] = _LiveRequest(
                stream, add.arrival, num_prompt_tokens=len(accepted.prompt_token_ids)
            )
            _call_soon(stream.loop, stream._accept, accepted.prompt, accepted.prompt_token_ids)
        for refused in update.refused:
            add = self._pending.pop(refused.request_id, None)
            if add is None:
                continue
            with self._lock:
                self._streams.pop(refused.request_id, None)
            _call_soon(add.stream.loop, add.stream._fail, refused.error)
        for request_id in update.aborted:
            live = self._live.pop(request_id, None)
            if live is not None:
                self._record_finished(request_id, live, "abort")
        if update.outputs:
            self._deliver(from_wire(update.outputs))
        if update.stats is not None:
            self._stats = update.stats

    def _closed_by_engine(self, closed: EngineClosed) -> None:
        for request_id in list(self._live):
            self._record_finished(request_id, self._live.pop(request_id), "abort")
        self._stats = closed.stats
        self._fail_all(lambda: EngineClosedError("the engine was shut down while the request ran"))
