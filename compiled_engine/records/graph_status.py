"""What the step graph reports about its compiled graphs: per step, and for the engine as a whole.

`GraphCall`: how the step graph ran one step — the graph it wanted (a token-count bucket, or
the dynamic graph), the graph it ran instead when that one was not built yet (a larger bucket,
the dynamic graph, or the traced graph run eagerly), and whether the step waited for a compile
or a load (and how long). The runner turns waits into `GraphWait`s on its timeline, so a stall
on the request path is visible in `LLM.stats()`.

`GraphStatus`: how many of the engine's graphs are ready (in memory), compiled (in the cache,
loaded on first use), compiling, queued for the background compiler, or failed. The server's
`/ready` and `/metrics` report it.
"""

from __future__ import annotations

from dataclasses import dataclass

# `GraphCall.ran` when no compiled graph could serve the step: the traced graph, run eagerly.
EAGER = "eager"


def graph_label(bucket: int | None) -> str:
    """A bucket as users read it: its token count, or "dynamic"."""
    return "dynamic" if bucket is None else str(bucket)


@dataclass(frozen=True)
class GraphCall:
    """How one step ran."""

    wanted: str  # graph_label of the bucket the step belongs in
    ran: str  # graph_label of the graph that ran, or EAGER
    waited: str | None = None  # "compile" or "load" when the step built its graph first
    wait_s: float = 0.0

    @property
    def fell_back(self) -> bool:
        return self.ran != self.wanted


@dataclass(frozen=True)
class GraphWait:
    """A step that waited on the request path for its graph to be compiled or loaded."""

    step: int  # the runner's step number (0: the first step after start-up)
    graph: str  # graph_label of the graph it waited for
    kind: str  # "compile" or "load"
    seconds: float


@dataclass(frozen=True)
class GraphStatus:
    """Counts over every graph the engine can run (its buckets, plus the dynamic graph if reachable)."""

    total: int = 0
    ready: int = 0  # in memory: steps run on it
    compiled: int = 0  # built by the background compiler, loaded on the first step that needs it
    compiling: int = 0
    queued: int = 0  # waiting for the background compiler
    failed: int = 0  # its compile or load failed: its steps run on a fallback graph
    on_demand: int = 0  # blocking policy: built by the first step that needs it
    policy: str = "blocking"

    @property
    def all_built(self) -> bool:
        """Nothing left to build (some may have failed)."""
        return self.compiling == 0 and self.queued == 0 and self.compiled == 0 and self.on_demand == 0

    def to_json(self) -> dict[str, int | str | bool]:
        return {
            "policy": self.policy,
            "total": self.total,
            "ready": self.ready,
            "compiled": self.compiled,
            "compiling": self.compiling,
            "queued": self.queued,
            "failed": self.failed,
            "on_demand": self.on_demand,
            "all_built": self.all_built,
        }
