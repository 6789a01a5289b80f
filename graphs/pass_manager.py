"""Runs graph passes in order over a captured GraphModule and records what each one did.

Every pass is a small object with a `name`, a `version` string and `__call__(gm) -> PassResult`.
The manager's `version()`/`uuid()` cover the pass list and the paged-attention op version, so
they can key a compile cache: change a pass (bump its version) or the op, and old artifacts
stop matching.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import fx

from compiled_engine.kernels.paged_attention import PAGED_ATTENTION_VERSION


@dataclass(frozen=True)
class PassResult:
    """What one pass did to one graph."""

    pass_name: str
    nodes_rewritten: int  # nodes replaced, removed or checked, as the pass defines it
    notes: tuple[str, ...] = ()  # anything worth reading in a log: skipped matches and why


@dataclass(frozen=True)
class PassReport:
    """All passes' results for one graph, in the order they ran."""

    results: tuple[PassResult, ...]

    def result(self, pass_name: str) -> PassResult:
        for result in self.results:
            if result.pass_name == pass_name:
                return result
        raise KeyError(f"no pass named {pass_name!r} ran; ran {[r.pass_name for r in self.results]}")

    def summary(self) -> str:
        lines = []
        for r in self.results:
            lines.append(f"{r.pass_name}: {r.nodes_rewritten}")
            lines.extend(f"  {note}" for note in r.notes)
        return "\n".join(lines)


class GraphPass(Protocol):
    name: str
    version: str

    def __call__(self, gm: fx.GraphModule) -> PassResult: ...


class PassManager:
    """Applies `passes` in order, then lints and recompiles the GraphModule once."""

    def __init__(self, passes: Sequence[GraphPass]) -> None:
        names = [p.name for p in passes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"pass names must be unique (they key the compile cache): {duplicates}")
        for p in passes:
            if not p.version:
                raise ValueError(f"pass {p.name!r} has an empty version string")
        self.passes: tuple[GraphPass, ...] = tuple(passes)

    def __call__(self, gm: fx.GraphModule) -> PassReport:
        results = []
        for graph_pass in self.passes:
            result = graph_pass(gm)
            if result.pass_name != graph_pass.name:
                raise ValueError(f"pass {graph_pass.name!r} reported its result as {result.pass_name!r}")
            results.append(result)
        gm.graph.lint()
        gm.recompile()
        return PassReport(tuple(results))

    def version(self) -> str:
        """Readable description of everything that shapes the output graph."""
        parts = [f"{p.name}={p.version}" for p in self.passes]
        parts.append(PAGED_ATTENTION_VERSION)
        return ";".join(parts)

    def uuid(self) -> str:
        """Stable hash of `version()`, for compile-cache keys."""
        return hashlib.sha256(self.version().encode()).hexdigest()
