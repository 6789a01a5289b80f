"""`DataParallelAsyncLLM`: D engine replicas behind one server (`--data-parallel-size D`).

Each replica is a whole engine in a process of its own (`ProcessAsyncLLM`: its own weights, KV
cache, scheduler and compiled graphs); the server talks to this facade exactly as to one engine.

- **Balancing.** A new request goes to the live replica with the fewest unfinished requests (its
  running plus waiting ones, counted where the server knows them at once: the streams it holds
  open on that replica), ties to the lowest index. Counting streams rather than reading the
  engines' step stats means a burst that arrives between two steps still spreads out.
- **Prefix affinity.** A prompt of at least `AFFINITY_TOKENS` tokens goes where the last prompt
  with the same first `AFFINITY_TOKENS` tokens went (a shared system prompt, few-shot examples),
  so that replica's prefix cache serves it — unless that replica is busier than the least busy
  one by more than `AFFINITY_SLACK` requests: then balance wins, and the prefix moves.
- **A replica that dies** (killed, out of memory, a step that raised) fails its own requests with
  `EngineDeadError` — what one engine does — and the others go on serving. A watcher thread
  notices within `WATCH_S`, starts a fresh replica in its place (same options) and from then on
  balances onto it too. `/health` stays 200 while any replica serves.
- **Metrics.** `/metrics` reports each replica's engine state under an `engine` label (vLLM's
  name for it); request timings from every replica feed the same histograms.

Other backends (Ray actors placed on other nodes) plug in as a different `start_replica`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

from compiled_engine.engine.async_llm import AsyncLLM, EngineClosedError, RequestStatsListener, RequestStream
from compiled_engine.engine_args import EngineArgs
from compiled_engine.records.graph_status import GraphStatus
from compiled_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How often the watcher looks for a dead replica to replace.
WATCH_S = 0.5
# Prefix affinity: the prompt head that names a prefix (four 16-token KV blocks), how much busier
# than the least busy replica an affine one may be, how many prefixes are remembered.
AFFINITY_TOKENS = 64
AFFINITY_SLACK = 4
AFFINITY_ENTRIES = 4096

ReplicaFactory = Callable[[int], AsyncLLM]


def replica_args(args: EngineArgs, size: int) -> EngineArgs:
    """One replica's options: a single engine; with local replicas on a CPU, the cores but one
    (left to the API server) shared out between them, unless the user chose the reservation.
    A replica on Ray resolves its own node's cores, and places its tensor-parallel / pipeline
    workers with Ray too (so its pipeline stages may run on other nodes)."""
    if args.distributed_executor_backend == "ray":
        return replace(args, data_parallel_size=1)
    one = replace(args, data_parallel_size=1)
    if args.cpu_reserved_cores is not None or "OMP_NUM_THREADS" in os.environ:
        return one
    cores = len(os.sched_getaffinity(0))
    threads = max(1, (cores - 1) // size)
    return replace(one, cpu_reserved_cores=max(0, cores - threads))


def replica_starter(args: EngineArgs, backend: str, log_requests: bool = True) -> Callable[[], AsyncLLM]:
    """How to start one engine the server talks to: a local engine process ("mp"), or an engine in
    a Ray actor that Ray places (spread over the nodes) ("ray")."""
    from compiled_engine.engine.process_async_llm import ProcessAsyncLLM

    if backend == "ray":
        from compiled_engine.engine.ray_engine import RayEngineHandle

        # One CPU claimed per replica (Ray's actors claim none while running by default), spread
        # over the nodes: replicas land on different nodes while there are free CPUs to take.
        return lambda: ProcessAsyncLLM(
            RayEngineHandle.start(args, num_cpus=1, scheduling_strategy="SPREAD"), log_requests=log_requests
        )
    return lambda: ProcessAsyncLLM.start(args, log_requests=log_requests)


def _prompt_head(prompt) -> int | None:
    """A hash of a token-id prompt's first AFFINITY_TOKENS tokens (None: shorter, or text)."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    if ids is None or len(ids) < AFFINITY_TOKENS:
        return None
    return hash(tuple(ids[:AFFINITY_TOKENS]))


class DataParallelAsyncLLM(AsyncLLM):
    """AsyncLLM's serving interface over replicas (it shares none of AsyncLLM's own state: every
    call goes to a replica; `generate` is AsyncLLM's, over this `add_request`)."""

    def __init__(self, start_replica: ReplicaFactory, size: int, *, restart: bool = True) -> None:
        """Start `size` replicas with `start_replica(index)` (in parallel; a failure to build any
        raises here, after the others are shut down)."""
        if size < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {size!r}")
        self._start_replica = start_replica
        self._restart = restart
        self._lock = threading.Lock()
        self._closed = False
        self._listeners: list[RequestStatsListener] = []
        self._replicas: list[AsyncLLM | None] = [None] * size
        # The streams open on each replica: its load, as the server sees it at once.
        self._replica_streams: list[dict[str, RequestStream]] = [{} for _ in range(size)]
        self._adding = [0] * size  # requests picked for a replica, not yet accepted by it
        self._prefix_home: OrderedDict[int, int] = OrderedDict()  # prompt head hash -> replica
        self.num_affine_picks = 0
        self.num_restarts = [0] * size
        errors: list[BaseException] = []

        def start(index: int) -> None:
            try:
                self._replicas[index] = start_replica(index)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after cleaning up
                errors.append(exc)

        starters = [threading.Thread(target=start, args=(i,)) for i in range(size)]
        for thread in starters:
            thread.start()
        for thread in starters:
            thread.join()
        if errors:
            for replica in self._replicas:
                if replica is not None:
                    replica.shutdown()
            raise errors[0]
        self._watcher = threading.Thread(target=self._watch, name="compiled-engine-dp-watcher", daemon=True)
        self._watcher.start()

    @classmethod
    def start(cls, args: EngineArgs, *, log_requests: bool = True) -> DataParallelAsyncLLM:
        """`args.data_parallel_size` replicas: engine processes on this machine, or Ray actors
        spread over the cluster's nodes (`distributed_executor_backend`)."""
        size = args.data_parallel_size
        start_one = replica_starter(replica_args(args, size), args.distributed_executor_backend, log_requests)
        return cls(lambda index: start_one(), size)

    # -- facts, from any live replica ----------------------------------------------------------------------

    def _any(self) -> AsyncLLM:
        for replica in self._replicas:
            if replica is not None:
                return replica
        raise EngineClosedError("no engine replica is running")

    @property
    def tokenizer(self):
        return self._any().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._any().max_model_len

    @property
    def model_dir(self) -> str:
        return self._any().model_dir

    @property
    def size(self) -> int:
        return len(self._replicas)

    def replicas(self) -> Sequence[AsyncLLM | None]:
        """The replicas now (None: being restarted); a restart replaces its entry."""
        return tuple(self._replicas)

    def replica_pids(self) -> list[int | None]:
        """Each replica's engine process id (None: being restarted, or not a process)."""
        return [getattr(r, "pid", None) for r in self._replicas]

    @property
    def errored(self) -> bool:
        """True once no replica can serve and none is coming back."""
        live = [r for r in self._replicas if r is not None and not r.errored]
        return not live and not (self._restart and not self._closed)

    @property
    def is_running(self) -> bool:
        return not self._closed and any(r is not None and r.is_running for r in self._replicas)

    def stats(self):
        """The first live replica's stats (`/metrics` reports each replica's own)."""
        return self._any().stats()

    def graph_status(self) -> GraphStatus:
        """Graph counts summed over the live replicas."""
        statuses = [r.graph_status() for r in self._replicas if r is not None and not r.errored]
        if not statuses:
            return GraphStatus()
        counts = ("total", "ready", "compiled", "compiling", "queued", "failed", "on_demand")
        summed = {name: sum(getattr(s, name) for s in statuses) for name in counts}
        return replace(statuses[0], **summed)

    def add_stats_listener(self, listener: RequestStatsListener) -> None:
        with self._lock:
            self._listeners.append(listener)
            replicas = [r for r in self._replicas if r is not None]
        for replica in replicas:
            replica.add_stats_listener(listener)

    # -- requests ------------------------------------------------------------------------------------------

    def _pick(self, prompt) -> int:
        head = _prompt_head(prompt)
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine has been shut down")
            best: int | None = None
            live = set()
            for index, replica in enumerate(self._replicas):
                if replica is None or replica.errored:
                    continue
                live.add(index)
                streams = self._replica_streams[index]
                for request_id in [rid for rid, s in streams.items() if s.finished]:
                    del streams[request_id]
                if best is None or self._load(index) < self._load(best):
                    best = index
            if best is None:
                raise EngineClosedError("no engine replica is serving (one is being restarted)")
            if head is not None:
                home = self._prefix_home.get(head)
                if home in live and self._load(home) <= self._load(best) + AFFINITY_SLACK:
                    best = home
                    self.num_affine_picks += 1
                self._prefix_home[head] = best
                self._prefix_home.move_to_end(head)
                if len(self._prefix_home) > AFFINITY_ENTRIES:
                    self._prefix_home.popitem(last=False)
            self._adding[best] += 1
            return best

    def _load(self, index: int) -> int:
        return len(self._replica_streams[index]) + self._adding[index]

    async def add_request(
        self, request_id: str, prompt, sampling_params: SamplingParams | None = None
    ) -> RequestStream:
        index = self._pick(prompt)
        replica = self._replicas[index]
        assert replica is not None
        try:
            stream = await replica.add_request(request_id, prompt, sampling_params)
        finally:
            with self._lock:
                self._adding[index] -= 1
        with self._lock:
            self._replica_streams[index][request_id] = stream
        return stream

    def abort_nowait(self, request_id: str) -> None:
        """Abort on whichever replica holds it (the others ignore an id they do not know)."""
        for replica in self._replicas:
            if replica is not None:
                replica.abort_nowait(request_id)

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        with self._lock:
            self._closed = True
            replicas = [r for r in self._replicas if r is not None]
        for replica in replicas:
            replica.shutdown(timeout)

    # -- replacing dead replicas ---------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closed:
            for index, replica in enumerate(self._replicas):
                if self._closed:
                    return
                if replica is not None and replica.errored and self._restart:
                    self._replace(index, replica)
            threading.Event().wait(WATCH_S)

    def _replace(self, index: int, dead: AsyncLLM) -> None:
        logger.warning("engine replica %d failed; starting a new one in its place", index)
        with self._lock:
            self._replicas[index] = None
            self._replica_streams[index].clear()  # its requests failed with EngineDeadError
        dead.shutdown(5.0)
        try:
            fresh = self._start_replica(index)
        except Exception:  # noqa: BLE001 - the others keep serving; the next pass tries again
            logger.exception("engine replica %d could not be restarted", index)
            with self._lock:
                self._replicas[index] = dead
            return
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:  # before it takes requests: their timings must be recorded
            fresh.add_stats_listener(listener)
        with self._lock:
            for listener in self._listeners[len(listeners) :]:  # added meanwhile
                fresh.add_stats_listener(listener)
            closed = self._closed
            if not closed:
                self._replicas[index] = fresh
                self.num_restarts[index] += 1
        if closed:
            fresh.shutdown()
            return
        logger.info("engine replica %d is serving again", index)
