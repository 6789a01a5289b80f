"""Bucket graphs compiled in a background process while the engine serves on fallback graphs.

`BackgroundBuilds(compiler, buckets, entry_dir, load)` starts the compiler in a fresh interpreter
(`CompilerProcess`; worker/graph_compiler_process.py: it loads the model, builds the
same compile-cache entry and compiles each bucket into it, niced below the serving process) and
watches its pipe on a thread. Per bucket the state moves

    queued → compiling → compiled → (first step that needs it) loading → ready
                       ↘ failed                                        ↘ failed

A compiled bucket is loaded from the cache on a second thread when a step first asks for it,
never on the step itself: that step and the ones after it run a fallback graph until
`take_ready()` (called by the step graph between steps) hands over the loaded callable.

Failures are warnings, never errors: a bucket whose compile fails, a compiler process that
dies (killed, out of memory), an artifact that fails its checks when loaded — each leaves the
affected buckets `failed`, and their steps keep running on fallback graphs.

Why a process, not a thread: a compile holds the GIL for seconds at a time (Dynamo, Inductor's
Python), which a serving thread would wait behind, and a niced process lets the OS schedule
serving first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from compiled_engine.records.graph_status import GraphStatus, graph_label

logger = logging.getLogger(__name__)

Bucket = int | None

# The interpreter's GIL switch interval while the loader thread loads a graph. Loading (unpickling,
# executing Inductor's generated wrapper module, opening its kernels) is seconds of Python that
# holds the GIL, and the step thread gives the GIL up at every kernel call; CPython hands it back
# only after the holder ran for the switch interval (5 ms by default), so each of a step's GIL
# round trips could wait that long while a graph loads. At 0.2 ms the step waits at most that.
LOADING_SWITCH_INTERVAL_S = 0.0002

# States of a bucket the background compiler owns.
QUEUED, COMPILING, COMPILED, LOADING, READY, FAILED = (
    "queued",
    "compiling",
    "compiled",
    "loading",
    "ready",
    "failed",
)


@dataclass(frozen=True)
class CompilerProcess:
    """How to start the background compiler: `python -m <module> <fd>` in a fresh interpreter.

    It reads `(job, buckets, entry_dir)` pickled from its stdin, compiles `buckets` in order
    into the compile-cache entry `entry_dir` and reports on a `Connection` over file
    descriptor `fd` (the messages below). A fresh interpreter, not multiprocessing: spawning
    through multiprocessing re-runs the user's main module in the child, which a script
    without a `__main__` guard cannot take. `job` must pickle."""

    module: str
    job: Any
    niceness: int  # its CPU priority, set as it is spawned, before its interpreter imports anything
    cores: tuple[int, ...] = ()  # pinned to these cores; () = wherever the OS puts it


# What the compiler process sends, one tuple per message.
def compiling_message(bucket: Bucket) -> tuple[str, Bucket]:
    return ("compiling", bucket)


def compiled_message(bucket: Bucket, seconds: float) -> tuple[str, Bucket, float]:
    return ("compiled", bucket, seconds)


def failed_message(bucket: Bucket, reason: str) -> tuple[str, Bucket, str]:
    return ("failed", bucket, reason)


def abort_message(reason: str) -> tuple[str, None, str]:
    """The compiler cannot go on (its model or cache entry differs): every bucket left fails."""
    return ("abort", None, reason)


def deprioritize(pid: int, niceness: int, cores: tuple[int, ...] = ()) -> None:
    """Lower process `pid` to Linux's idle scheduling class (SCHED_IDLE) at `niceness` and, when
    `cores` is given, pin it there. Called on the compiler just after it was spawned, while its
    interpreter is still starting, so its imports run there too (seconds of CPU a step would
    otherwise share a core with); the threads and processes it makes later (Inductor's compile
    workers) inherit all three.

    Why SCHED_IDLE as well as nice 19: a nice-19 task holding a core may run out its time slice
    before a waking serving thread gets the core; a SCHED_IDLE task is preempted by any normal task
    as soon as that wakes. On the cold-serving bench the engine's own p99/p50 inter-token latency
    was 1.68-1.93 with it against 1.91-2.11 with nice alone, three runs each (docs/performance.md,
    "Session 13")."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, niceness)
    except OSError:  # not allowed, or it already exited: it runs at normal priority
        pass
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux, not allowed, or it already exited: nice only
        pass
    if cores:
        try:
            os.sched_setaffinity(pid, cores)
        except OSError:  # a core went away, or it already exited: it runs anywhere
            pass


@contextlib.contextmanager
def short_switch_interval(seconds: float):
    """Lower the interpreter's GIL switch interval to at most `seconds` for the block (the loader
    is the only thread that changes it, and it restores the value it found)."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


class BackgroundBuilds:
    """The background compiler of one compiled step, and the state of every bucket it owns.

    `entry_dir`: the compile-cache entry the compiler must build into (the step's own).
    `load(bucket)`: the bucket's callable from the compile cache, or None when the artifact is
    missing or fails its checks (the cache removes such a file and says why).
    """

    def __init__(
        self,
        compiler: CompilerProcess,
        buckets: Sequence[Bucket],
        entry_dir: str,
        load: Callable[[Bucket], Callable[..., Any] | None],
    ) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._states: dict[Bucket, str] = {bucket: QUEUED for bucket in buckets}
        self._ready: list[tuple[Bucket, Callable[..., Any]]] = []  # loaded, not yet taken
        self._load_requests: queue.SimpleQueue[tuple[Bucket] | None] = queue.SimpleQueue()
        read_fd, write_fd = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", compiler.module, str(write_fd)],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
        )
        os.close(write_fd)  # the child holds the only writing end: its exit closes the pipe
        deprioritize(self.process.pid, compiler.niceness, compiler.cores)
        receiver = Connection(read_fd, writable=False)
        assert self.process.stdin is not None
        try:
            pickle.dump((compiler.job, list(buckets), entry_dir), self.process.stdin)
            self.process.stdin.close()
        except OSError:  # it died at once: the watcher reports it
            pass
        # The threads hold only a weak reference to this object, so dropping the engine ends them
        # (through the finalizer, which also stops the compiler).
        me = weakref.ref(self)
        self._watcher = threading.Thread(
            target=_watch, args=(me, receiver, self.process), name="graph-compiler-watch", daemon=True
        )
        self._loader = threading.Thread(
            target=_load_loop, args=(me, self._load_requests), name="graph-loader", daemon=True
        )
        self._watcher.start()
        self._loader.start()
        self._finalizer = weakref.finalize(self, _stop, self.process, self._load_requests)
        logger.info(
            "compiling %d graph(s) in the background (pid %d): %s; steps run on fallback graphs meanwhile",
            len(buckets),
            self.process.pid,
            ", ".join(graph_label(b) for b in buckets),
        )

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def running(self) -> bool:
        """Whether the compiler process is still alive."""
        return self.process.poll() is None

    def state(self, bucket: Bucket) -> str | None:
        """The bucket's state, or None when the background compiler does not own it."""
        with self._lock:
            return self._states.get(bucket)

    def request(self, bucket: Bucket) -> None:
        """A step wants `bucket`: if it is compiled, start loading it (off the step's thread)."""
        with self._lock:
            if self._states.get(bucket) != COMPILED:
                return
            self._states[bucket] = LOADING
        self._load_requests.put((bucket,))

    def take_ready(self) -> list[tuple[Bucket, Callable[..., Any]]]:
        """Buckets loaded since the last call, with their callables (the caller now owns them)."""
        with self._lock:
            ready, self._ready = self._ready, []
        return ready

    def counts(self) -> dict[str, int]:
        with self._lock:
            states = list(self._states.values())
        return {state: states.count(state) for state in (QUEUED, COMPILING, COMPILED, LOADING, READY, FAILED)}

    def status(self, total: int, ready_elsewhere: int, policy: str) -> GraphStatus:
        """Counts over all `total` graphs; `ready_elsewhere`: ready ones this compiler never owned."""
        counts = self.counts()
        return GraphStatus(
            total=total,
            ready=ready_elsewhere + counts[READY],
            compiled=counts[COMPILED] + counts[LOADING],
            compiling=counts[COMPILING],
            queued=counts[QUEUED],
            failed=counts[FAILED],
            policy=policy,
        )

    def wait_until_built(self, timeout: float | None = None) -> bool:
        """Block until the compiler has finished with every bucket (tests, tools); True if it has."""
        self._watcher.join(timeout)
        return not self._watcher.is_alive()

    def close(self) -> None:
        """Stop the compiler process and the loader (what is compiled stays in the cache)."""
        self._finalizer()

    # -- what the two threads do (module functions below run them) -----------------------------------------

    def _on_report(self, kind: str, bucket: Bucket, detail: Any) -> str | None:
        """One report of the compiler; returns why it gave up, if it did."""
        if kind == "compiling":
            self._set(bucket, COMPILING)
        elif kind == "compiled":
            self._set(bucket, COMPILED)
            logger.info("background compile of graph %s done in %.1f s", graph_label(bucket), detail)
        elif kind == "failed":
            self._set(bucket, FAILED)
            logger.warning(
                "background compile of graph %s failed; its steps keep running on a fallback graph: %s",
                graph_label(bucket),
                detail,
            )
        elif kind == "abort":
            return f"it gave up: {detail}"
        return None

    def _on_compiler_exit(self, reason: str | None) -> None:
        """The compiler is gone: whatever it had not finished fails."""
        with self._lock:
            left = [b for b, s in self._states.items() if s in (QUEUED, COMPILING)]
            for bucket in left:
                self._states[bucket] = FAILED
        if not left:
            return
        if reason is None:
            code = self.process.returncode
            reason = (
                f"it was killed by signal {-code}" if code is not None and code < 0 else f"it exited ({code})"
            )
        logger.warning(
            "the background graph compiler (pid %s) stopped before graphs %s were built: %s. Their "
            "steps keep running on fallback graphs; `compiled-engine warmup` builds them ahead of time.",
            self.process.pid,
            ", ".join(graph_label(b) for b in left),
            reason,
        )

    def _load_one(self, bucket: Bucket) -> None:
        try:
            with short_switch_interval(LOADING_SWITCH_INTERVAL_S):
                loaded = self._load(bucket)
        except Exception as exc:  # noqa: BLE001 - a bad artifact must not end the loader
            logger.warning("loading graph %s failed: %r", graph_label(bucket), exc)
            loaded = None
        with self._lock:
            if loaded is None:
                self._states[bucket] = FAILED
            else:
                self._states[bucket] = READY
                self._ready.append((bucket, loaded))
        if loaded is None:
            logger.warning(
                "graph %s was compiled in the background but its artifact could not be loaded; its "
                "steps keep running on a fallback graph",
                graph_label(bucket),
            )

    def _set(self, bucket: Bucket, state: str) -> None:
        with self._lock:
            if bucket in self._states:
                self._states[bucket] = state


def _watch(
    builds_ref: weakref.ref[BackgroundBuilds], receiver: Connection, process: subprocess.Popen[bytes]
) -> None:
    """The watcher thread: read the compiler's reports until it exits."""
    reason = None
    try:
        while reason is None:
            try:
                message = receiver.recv()
            except (EOFError, OSError):
                break
            builds = builds_ref()
            if builds is None:  # the engine is gone (its finalizer stops the compiler)
                return
            reason = builds._on_report(*(*message, None)[:3])
            del builds
    finally:
        receiver.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    builds = builds_ref()
    if builds is not None:
        builds._on_compiler_exit(reason)


def _load_loop(
    builds_ref: weakref.ref[BackgroundBuilds], requests: queue.SimpleQueue[tuple[Bucket] | None]
) -> None:
    """The loader thread: load each graph a step asked for, off the step's thread."""
    while True:
        request = requests.get()
        builds = builds_ref()
        if request is None or builds is None:  # closed, or the engine is gone
            return
        builds._load_one(request[0])
        del builds


def _stop(process: subprocess.Popen[bytes], load_requests: queue.SimpleQueue[tuple[Bucket] | None]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    load_requests.put(None)
