"""A real HTTP server under test, started as a user would, and what every serving suite measures.

`ServerProcess` launches a server command in its own process group (anything it starts — our
background compiler, vLLM's engine core — goes with it), waits for its /health, and stops it.
`serve_command` is `compiled-engine serve` with the bench's options; `StreamRecord` is one streamed
request seen from the client (send time, every chunk's arrival), `quiet_client_heap` keeps the
client's own garbage collector out of those times, and `percentile` is the one rule every summary
uses. bench/test_cold_start_serving.py and bench/test_serving.py share them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SERVER_START_TIMEOUT_S = 600


@dataclass
class StreamRecord:
    """One request's stream, times in seconds from the workload's start."""

    sent_at: float
    chunk_at: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    expected_tokens: int = 0
    abandoned: bool = False  # the client closed the stream early, on purpose


@dataclass
class ClientCollections:
    """The measuring client's own garbage collections while it measured (full ones are the pauses
    that matter: each would show as a gap in every open stream at once)."""

    full: int = 0
    longest_s: float = 0.0


@contextlib.contextmanager
def quiet_client_heap():
    """Keep the client's collector out of what it measures. The client's start-up heap (openai,
    httpx, pydantic: ~100k objects) is frozen, as the server freezes its own
    (engine/startup_heap.py): a full collection walking it took 50-220 ms here, a pause every open
    stream would record as a server stall. Full collections that still run are counted and timed."""
    seen = ClientCollections()
    started = [0.0]

    def watch(phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            seen.full += 1
            seen.longest_s = max(seen.longest_s, time.perf_counter() - started[0])

    gc.collect()
    gc.freeze()
    gc.callbacks.append(watch)
    try:
        yield seen
    finally:
        gc.callbacks.remove(watch)
        gc.unfreeze()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    if len(ordered) == 1:
        return ordered[0]
    # Linear interpolation between closest ranks (numpy's default).
    pos = q / 100 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def inter_chunk_gaps(streams: list[StreamRecord]) -> list[tuple[float, float]]:
    """(gap, when it ended) between consecutive chunks of each stream, all streams."""
    gaps: list[tuple[float, float]] = []
    for s in streams:
        gaps += [(b - a, b) for a, b in zip(s.chunk_at, s.chunk_at[1:], strict=False)]
    return gaps


def http_get(url: str, timeout: float = 10) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read().decode()


def free_port() -> int:
    """A port nothing listens on now, for a server that cannot bind port 0 and say which it got."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(
    model_dir: Path,
    dtype: str,
    served_name: str,
    cache_dir: Path,
    policy: str | None = None,
    flags: tuple[str, ...] = (),
) -> list[str]:
    """`compiled-engine serve` on 127.0.0.1 (port 0: it prints the one it got)."""
    command = [
        sys.executable, "-m", "compiled_engine.entrypoints.cli", "serve", "--model", str(model_dir),
        "--dtype", dtype, "--host", "127.0.0.1", "--port", "0", "--served-model-name", served_name,
        "--cache-dir", str(cache_dir),
    ]  # fmt: skip
    if policy is not None:
        command += ["--compile-policy", policy]
    return command + list(flags)


class ServerProcess:
    """A server subprocess logging to `log_path`, in a session of its own. `url`: given, or read
    from our server's "serving ... on http://..." line once it is printed."""

    def __init__(
        self, command: list[str], log_path: Path, env: dict[str, str], url: str = "", cwd: Path | None = None
    ) -> None:
        self.log_path = log_path
        self.url = url
        self.launched = time.perf_counter()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=cwd
            )

    def wait_healthy(self, timeout_s: float = SERVER_START_TIMEOUT_S) -> float:
        """Seconds from launch to the first 200 from /health."""
        deadline = self.launched + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            if not self.url:
                found = re.search(r"serving .* on (http://\S+)", self.log())
                self.url = found.group(1) if found else ""
            if self.url:
                try:
                    if http_get(f"{self.url}/health")[0] == 200:
                        return time.perf_counter() - self.launched
                except OSError:
                    pass
            assert time.perf_counter() < deadline, f"no /health in time:\n{self.log()[-4000:]}"
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the group this server started (compiler, engine core): gone.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
