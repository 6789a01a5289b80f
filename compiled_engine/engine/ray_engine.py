"""An engine replica in a Ray actor, placed by Ray on any node of a cluster
(`--distributed-executor-backend ray`).

The actor runs exactly the engine process's loop (`engine_process.serve_engine`) on a thread of
its own, reading commands from and writing updates to in-actor queues (`_QueueConnection` has
the three methods of `multiprocessing.connection.Connection` the loop uses). The server's side,
`RayEngineHandle`, offers what `ProcessAsyncLLM` reads of an `EngineProcess` — the start-up report,
a connection whose `send` is a remote `submit` call and whose `recv` long-polls the actor's
`receive`, the pid, and `close` — so `ProcessAsyncLLM(RayEngineHandle.start(args))` is the same
client as for a local engine process. The actor dying (killed, its node lost) surfaces as the
connection closing: every waiter gets `EngineDeadError`, as when a local engine process dies.

`compiled-engine serve` joins the cluster `RAY_ADDRESS` names (or the one `ray start` left on
this node, with `RAY_ADDRESS=auto`); with neither it starts a local one.
"""

from __future__ import annotations

import os
import queue
import threading
import traceback
from typing import Any

from compiled_engine.distributed.ray_cluster import connect_ray
from compiled_engine.engine.engine_process import (
    EngineFailed,
    EngineReady,
    _picklable,
    engine_environment,
    serve_engine,
    serving_defaults,
)
from compiled_engine.engine_args import EngineArgs

# How long one `receive` call waits for news before returning empty (the server's reader asks again).
RECEIVE_WAIT_S = 1.0
START_TIMEOUT_S = 1800.0


class _QueueConnection:
    """The actor's end: commands in (`poll`/`recv`), updates out (`send`)."""

    def __init__(self) -> None:
        self.inbox: queue.Queue[list] = queue.Queue()
        self.outbox: queue.Queue[Any] = queue.Queue()
        self._next: list | None = None

    def poll(self, timeout: float) -> bool:
        if self._next is None:
            try:
                self._next = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
            except queue.Empty:
                return False
        return True

    def recv(self) -> list:
        if self._next is None:
            return self.inbox.get()
        message, self._next = self._next, None
        return message

    def send(self, message: Any) -> None:
        self.outbox.put(message)


class EngineActor:
    """Hosts one LLMEngine and its loop. Made a Ray actor class by `_actor_class()` (Ray is
    imported only when this backend is used)."""

    def __init__(self, args: EngineArgs) -> None:
        self._conn = _QueueConnection()
        self._thread = threading.Thread(
            target=self._run, args=(args,), name="compiled-engine-loop", daemon=True
        )
        self._thread.start()

    def _run(self, args: EngineArgs) -> None:
        try:
            from compiled_engine.engine.llm_engine import LLMEngine
            from compiled_engine.engine.startup_heap import freeze_startup_heap

            engine = LLMEngine(serving_defaults(args))
            freeze_startup_heap()  # the actor's process is ours alone (engine/startup_heap.py)
            config = engine.config
            self._conn.send(
                EngineReady(config.max_model_len, config.model_dir, engine.tokenizer, engine.stats())
            )
            serve_engine(engine, self._conn)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the server
            self._conn.send(EngineFailed(_picklable(exc), traceback.format_exc()))

    def submit(self, messages: list) -> None:
        self._conn.inbox.put(messages)

    def receive(self, timeout_s: float) -> list:
        """What the loop sent since the last call, waiting up to `timeout_s` for the first."""
        try:
            messages = [self._conn.outbox.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                messages.append(self._conn.outbox.get_nowait())
            except queue.Empty:
                return messages

    def where(self) -> tuple[int, str]:
        """This actor's process id and Ray node id."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()


def _actor_class():
    import ray

    # Threaded: `receive` blocks while `submit` calls keep coming.
    return ray.remote(max_concurrency=4)(EngineActor)  # type: ignore[call-overload]


class _ActorConnection:
    """The server's end: `send` → the actor's `submit`; `recv` → its `receive`, one message at a time."""

    def __init__(self, actor) -> None:
        self._actor = actor
        self._buffered: list = []

    def send(self, messages: list) -> None:
        import ray

        try:
            ray.get(self._actor.submit.remote(messages))
        except ray.exceptions.RayActorError as exc:
            raise OSError(f"the engine actor is gone: {exc}") from None

    def recv(self) -> Any:
        import ray

        while not self._buffered:
            try:
                self._buffered = ray.get(self._actor.receive.remote(RECEIVE_WAIT_S))
            except ray.exceptions.RayActorError:
                raise EOFError("the engine actor is gone") from None
        return self._buffered.pop(0)

    def close(self) -> None:
        pass


class RayEngineHandle:
    """What ProcessAsyncLLM needs of an engine process, for an engine in a Ray actor."""

    def __init__(self, actor, ready: EngineReady, pid: int, node_id: str) -> None:
        self.actor = actor
        self.conn = _ActorConnection(actor)
        self.ready = ready
        self.pid = pid
        self.node_id = node_id

    @classmethod
    def start(cls, args: EngineArgs, **actor_options: Any) -> RayEngineHandle:
        """Create the actor (Ray's `actor_options`, e.g. a scheduling strategy) and wait until its
        engine is built; a failure to build raises here, as the engine raised it."""
        import ray

        connect_ray()
        env = engine_environment({})
        actor = _actor_class().options(runtime_env={"env_vars": env}, **actor_options).remote(args)
        conn = _ActorConnection(actor)
        try:
            pid, node_id = ray.get(actor.where.remote(), timeout=START_TIMEOUT_S)
            first = conn.recv()
        except BaseException:
            ray.kill(actor)
            raise
        if isinstance(first, EngineFailed):
            ray.kill(actor)
            raise first.error
        assert isinstance(first, EngineReady), first
        return cls(actor, first, pid, node_id)

    def describe_exit(self) -> str:
        return f"the engine's Ray actor (pid {self.pid}, node {self.node_id[:12]}) died"

    def close(self, timeout_s: float = 30.0) -> None:
        """End the actor. ProcessAsyncLLM.shutdown calls it after its reader saw the loop close (or
        gave up waiting), so nothing is left to wait for here; `timeout_s` is EngineProcess's."""
        import ray

        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass
