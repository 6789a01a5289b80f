"""The engine in a process of its own, for the server: no step ever holds the API server's GIL.

`EngineProcess.start(args)` runs `python -m compiled_engine.engine.engine_process FD` in a fresh
interpreter (not multiprocessing: spawning that way re-runs the user's main module, and a
daemonic child could not start tensor-parallel workers). The two sides talk over a socket pair
wrapped in `multiprocessing.connection.Connection`, one pickled record per message:

    server → engine: a list of `AddRequest` / `AbortRequests` / `Shutdown` (batched by a sender thread)
    engine → server: `EngineReady` once built (or `EngineFailed`), then one `EngineUpdate` per loop
                     iteration that has news (accepted and refused requests, applied aborts, the
                     step's outputs as tuples (records/output_delta.py), stats), `EngineClosed`
                     after a shutdown, `EngineFailed` if a step raised.

The engine side (`serve_engine`) runs the loop AsyncLLM's engine thread runs in-process: apply the
commands that arrived, run one step while anything is unfinished, send what happened. Output
processing (detokenizing, stop strings) stays with the engine, so the server process only frames
HTTP. The engine leaves when its parent dies (the pipe closes, or its parent pid changes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from compiled_engine.distributed.ray_cluster import openmp_environment
from compiled_engine.engine.stats import EngineStats
from compiled_engine.engine_args import SERVING_LONG_PREFILL_DEFAULT
from compiled_engine.records.output_delta import WireOutput, to_wire
from compiled_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Socket buffers big enough that a burst of requests (or one step's outputs) never blocks a writer.
SOCKET_BUFFER_BYTES = 8 * 2**20
# While idle the engine wakes this often to report graphs the background compiler finished.
IDLE_POLL_S = 0.25
PARENT_POLL_S = 1.0
START_TIMEOUT_S = 1800.0


# -- messages ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: Any
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class EngineReady:
    max_model_len: int
    model_dir: str
    tokenizer: Any
    stats: EngineStats


@dataclass(frozen=True)
class Accepted:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Refused:
    request_id: str
    error: BaseException  # the engine's InvalidRequestError / ValueError / TypeError


@dataclass
class EngineUpdate:
    accepted: list[Accepted] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # aborts applied (requests it knew)
    outputs: list[WireOutput] = field(default_factory=list)  # the step's, without prompts
    stats: EngineStats | None = None


@dataclass(frozen=True)
class EngineClosed:
    stats: EngineStats


@dataclass(frozen=True)
class EngineFailed:
    error: BaseException  # the exception itself when it pickles, else a RuntimeError naming it
    traceback: str


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


# -- the server's side --------------------------------------------------------------------------------------


class EngineProcessError(RuntimeError):
    """The engine process could not start, or went away."""


class EngineProcess:
    """The engine process and the server's end of its connection."""

    def __init__(self, process: subprocess.Popen[bytes], conn: Connection, ready: EngineReady) -> None:
        self.process = process
        self.conn = conn
        self.ready = ready

    @classmethod
    def start(cls, args, log_level: int | None = None) -> EngineProcess:
        """Start the engine on `args` (an EngineArgs) and wait until it is built. A failure to
        build is raised here, as the exception the engine raised (a bad model folder, say)."""
        ours, theirs = socket.socketpair()
        for sock in (ours, theirs):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            stdin=subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
            env=engine_environment(os.environ),
        )
        theirs.close()  # the child holds the only other end: its exit closes the connection
        conn = Connection(ours.detach())
        assert process.stdin is not None
        try:
            pickle.dump((args, level), process.stdin)
            process.stdin.close()
        except OSError:
            pass  # it died at once: the read below says so
        try:
            first = _recv_within(conn, process, START_TIMEOUT_S)
        except BaseException:
            _end(process)
            conn.close()
            raise
        if isinstance(first, EngineFailed):
            _end(process)
            conn.close()
            raise first.error
        assert isinstance(first, EngineReady), first
        return cls(process, conn, first)

    @property
    def pid(self) -> int:
        return self.process.pid

    def describe_exit(self) -> str:
        """Why the connection closed, for the error every waiter gets."""
        code = self.process.wait(30)
        return f"the engine process exited unexpectedly (exit code {code})"

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for the process to leave (it was told to shut down), else kill it."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _end(self.process)
        self.conn.close()


def engine_environment(environ) -> dict[str, str]:
    """The engine process's environment: the server's, with OpenMP's short spin unless the user
    chose a wait policy (distributed/ray_cluster.py says why)."""
    return openmp_environment(environ)


def serving_defaults(args):
    """`args` (an EngineArgs) with the engine process's own defaults resolved, where the user did
    not choose: one core left to the API server and its clients (`cpu_reserved_cores`) unless
    OMP_NUM_THREADS is set or the machine has a single core; and the per-device cap on the prompt
    tokens of a step while requests decode (`long_prefill_token_threshold`,
    SERVING_LONG_PREFILL_DEFAULT)."""
    chosen = {}
    if args.cpu_reserved_cores is None:
        spare = "OMP_NUM_THREADS" not in os.environ and len(os.sched_getaffinity(0)) >= 2
        chosen["cpu_reserved_cores"] = 1 if spare else 0
    if args.long_prefill_token_threshold is None:
        device = args.resolve_device().type
        chosen["long_prefill_token_threshold"] = SERVING_LONG_PREFILL_DEFAULT.get(device, 0)
    return dataclasses.replace(args, **chosen) if chosen else args


def _recv_within(conn: Connection, process: subprocess.Popen[bytes], timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.1):
        if process.poll() is not None:
            code = process.returncode
            raise EngineProcessError(f"the engine process exited while starting (exit code {code})")
        if time.monotonic() > deadline:
            raise EngineProcessError(f"the engine process did not start within {timeout_s:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        process.wait(10)
        raise EngineProcessError(
            f"the engine process exited while starting (exit code {process.returncode})"
        ) from None


def _end(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(30)


# -- the engine's side --------------------------------------------------------------------------------------


class LoopConnection(Protocol):
    """What the engine loop uses of its connection: a `Connection` here, queues in a Ray actor
    (engine/ray_engine.py)."""

    def poll(self, timeout: float) -> bool: ...

    def recv(self) -> Any: ...

    def send(self, obj: Any) -> None: ...


def serve_engine(engine, conn: LoopConnection) -> None:
    """Run `engine` (an LLMEngine) on the commands from `conn` until a Shutdown (or the parent goes)."""
    idle_stats: EngineStats | None = None  # what was last sent while idle
    while True:
        busy = engine.has_unfinished_requests()
        commands: list = []
        if conn.poll(0 if busy else IDLE_POLL_S):
            commands += conn.recv()
            while conn.poll(0):
                commands += conn.recv()
        update = EngineUpdate()
        for command in commands:
            if isinstance(command, Shutdown):
                _close(engine, conn)
                return
            if isinstance(command, AddRequest):
                _add(engine, command, update)
            else:
                _abort(engine, command, update)
        if engine.has_unfinished_requests():
            update.outputs = to_wire(engine.step())
        update.stats = engine.stats()
        if commands or busy:
            conn.send(update)
            idle_stats = None
        elif update.stats != idle_stats:  # idle: only news (a graph the compiler finished)
            conn.send(update)
            idle_stats = update.stats


def _add(engine, command: AddRequest, update: EngineUpdate) -> None:
    try:
        processed = engine.input_processor.process(command.prompt, command.params, command.request_id)
        engine.add_request(command.request_id, processed, command.params)
    except (ValueError, TypeError) as exc:
        # A problem with this request alone (InvalidRequestError is a ValueError).
        update.refused.append(Refused(command.request_id, _picklable(exc)))
        return
    update.accepted.append(Accepted(command.request_id, processed.prompt, tuple(processed.prompt_token_ids)))


def _abort(engine, command: AbortRequests, update: EngineUpdate) -> None:
    known = [rid for rid in command.request_ids if engine.output_processor.has_request(rid)]
    if known:
        engine.abort_request(known)
    update.aborted.extend(command.request_ids)


def _close(engine, conn: LoopConnection) -> None:
    """Shutdown: end what is still running, collect steps in flight, say so, stop the compiler."""
    try:
        engine.drain()
    finally:
        stats = engine.stats()
        engine.close()
        conn.send(EngineClosed(stats))


def _exit_if_orphaned(parent_pid: int) -> None:
    """The server is gone (killed): leave too, even from inside a long step."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def main(argv: list[str]) -> int:
    # The server decides when the engine stops: a Ctrl-C (the whole foreground group gets SIGINT)
    # or a SIGTERM sent to every process of a service must not end it before the server has let
    # its streams finish. It leaves on Shutdown, or when the server is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    args, level = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=level)
    threading.Thread(target=_exit_if_orphaned, args=(os.getppid(),), daemon=True).start()
    try:
        from compiled_engine.engine.llm_engine import LLMEngine
        from compiled_engine.engine.startup_heap import freeze_startup_heap

        engine = LLMEngine(serving_defaults(args))
        freeze_startup_heap()  # no collector pass over the start-up heap mid-stream
        config = engine.config
        conn.send(EngineReady(config.max_model_len, config.model_dir, engine.tokenizer, engine.stats()))
        serve_engine(engine, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 1  # the server went away: nobody is left to tell
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the server
        try:
            conn.send(EngineFailed(_picklable(exc), traceback.format_exc()))
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    # Through the module's own name: the records it sends must unpickle as engine_process's, not
    # as __main__'s.
    from compiled_engine.engine import engine_process

    sys.exit(engine_process.main(sys.argv[1:]))
