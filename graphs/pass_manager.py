"""One pass manager for every graph rewrite: at capture, and per bucket graph.

A graph pass is a small object with a `name`, a `version` (a hash of its source,
kernels/source_version.py) and `__call__(gm) -> PassResult`. The manager holds the whole
pipeline, each entry saying where it applies:

- `AtCapture(make)`: on every graph Dynamo hands the backend (graphs/capture.py), in order.
  `make(CaptureGraph)` builds the pass for that graph; most passes are one shared instance
  (`at_capture(pass)`), freeze_parameters is built per graph from the graph's example inputs.
- `PerBucket(applies, make)`: on each bucket's variant of the traced graph
  (graphs/bucket_compiler.py) where `applies(BucketTarget)` holds; `make(target)` builds it.

Every run returns a `PassReport` of the passes that ran, which the callers keep: capture
reports in `CapturedModel.pass_log`, bucket reports in each bucket's build record, its
compile-cache artifact header, the warmup table and the graph dumps (graphs/graph_dump.py).

`versions()` names every pass and its version, so they can key a compile cache: change a
pass's source, or the op's, and old artifacts stop matching.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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

    def ran(self, pass_name: str) -> bool:
        return any(r.pass_name == pass_name for r in self.results)

    def summary(self) -> str:
        lines = []
        for r in self.results:
            lines.append(f"{r.pass_name}: {r.nodes_rewritten}")
            lines.extend(f"  {note}" for note in r.notes)
        return "\n".join(lines)

    def to_json(self) -> list[dict[str, Any]]:
        """Plain JSON values (a compile-cache artifact header stores them)."""
        return [
            {"pass": r.pass_name, "nodes": r.nodes_rewritten, "notes": list(r.notes)} for r in self.results
        ]

    @classmethod
    def from_json(cls, data: Any) -> PassReport:
        """Parse `to_json` output; ValueError when it is malformed."""
        if not isinstance(data, list):
            raise ValueError(f"a pass report is a list, got {type(data).__name__}")
        try:
            return cls(
                tuple(PassResult(str(r["pass"]), int(r["nodes"]), tuple(map(str, r["notes"]))) for r in data)
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed pass report: {exc!r}") from exc


class GraphPass(Protocol):
    name: str
    version: str

    def __call__(self, gm: fx.GraphModule) -> PassResult: ...


class LinearForms(Protocol):
    """How each bucket runs its linears (graphs/gemv_policy.py's GemvDecision)."""

    def lowers(self, rows: int) -> bool: ...

    def runs_kernel(self, rows: int) -> bool: ...

    def runs_quantized_kernel(self, rows: int) -> bool: ...

    def runs_quantized_tiles(self, rows: int | None) -> bool: ...

    def packs(self, rows: int | None) -> bool: ...

    def widens(self, rows: int | None) -> bool: ...


@dataclass(frozen=True)
class CaptureGraph:
    """What a capture-time pass may know about the graph Dynamo handed the backend."""

    example_inputs: tuple[Any, ...]  # Dynamo's real inputs, in placeholder order


@dataclass(frozen=True)
class BucketTarget:
    """The bucket graph a per-bucket pass would rewrite, and what decides whether it does."""

    bucket: int | None  # token rows the graph is compiled for; None: the dynamic graph
    max_num_seqs: int
    device_kind: str  # "cpu", "cuda", ...
    attention_backend: str  # the resolved backend's name ("torch", "cpu", "triton")
    linears: LinearForms

    @property
    def decode_sized(self) -> bool:
        """A bucket that can be a whole decode batch (one token per sequence)."""
        return self.bucket is not None and self.bucket <= self.max_num_seqs


@dataclass(frozen=True)
class AtCapture:
    """Runs on every captured graph; `make` builds the pass for one graph."""

    make: Callable[[CaptureGraph], GraphPass]


@dataclass(frozen=True)
class PerBucket:
    """Runs on a bucket's graph where `applies(target)` holds; `make` builds the pass for it."""

    applies: Callable[[BucketTarget], bool]
    make: Callable[[BucketTarget], GraphPass]


@dataclass(frozen=True)
class PipelinePass:
    """One entry of the pipeline: a pass's name and version, and where it applies."""

    name: str
    version: str
    where: AtCapture | PerBucket


def at_capture(graph_pass: GraphPass) -> PipelinePass:
    """`graph_pass` itself, run on every captured graph."""
    return PipelinePass(graph_pass.name, graph_pass.version, AtCapture(lambda _graph: graph_pass))


def per_bucket(
    pass_type: type[Any],
    applies: Callable[[BucketTarget], bool],
    make: Callable[[BucketTarget], GraphPass] | None = None,
) -> PipelinePass:
    """A pass of `pass_type` (its class `name` and `version`) on the buckets `applies` picks;
    built by `make(target)`, default `pass_type()`."""
    build = make if make is not None else (lambda _target: pass_type())
    return PipelinePass(pass_type.name, pass_type.version, PerBucket(applies, build))


class PassManager:
    """Runs the pipeline's passes on a graph, in order, then lints and recompiles it once.

    `passes`: pipeline entries, or plain passes (run on every captured graph).
    """

    def __init__(self, passes: Sequence[GraphPass | PipelinePass]) -> None:
        entries = [p if isinstance(p, PipelinePass) else at_capture(p) for p in passes]
        names = [p.name for p in entries]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"pass names must be unique (they key the compile cache): {duplicates}")
        for p in entries:
            if not p.version:
                raise ValueError(f"pass {p.name!r} has an empty version string")
        self.pipeline: tuple[PipelinePass, ...] = tuple(entries)

    @property
    def capture_passes(self) -> tuple[PipelinePass, ...]:
        return tuple(p for p in self.pipeline if isinstance(p.where, AtCapture))

    @property
    def bucket_passes(self) -> tuple[PipelinePass, ...]:
        return tuple(p for p in self.pipeline if isinstance(p.where, PerBucket))

    def run_capture(self, gm: fx.GraphModule, example_inputs: Sequence[Any] = ()) -> PassReport:
        """Every capture-time pass on a graph Dynamo captured (`example_inputs`: its inputs)."""
        graph = CaptureGraph(tuple(example_inputs))
        passes = []
        for entry in self.capture_passes:
            assert isinstance(entry.where, AtCapture)
            passes.append(entry.where.make(graph))
        return self._run(gm, passes, None)

    __call__ = run_capture

    def run_bucket(self, gm: fx.GraphModule, target: BucketTarget) -> PassReport:
        """The per-bucket passes that apply to `target`, on its graph (a variant of the traced one)."""
        passes = []
        for entry in self.bucket_passes:
            assert isinstance(entry.where, PerBucket)
            if entry.where.applies(target):
                passes.append(entry.where.make(target))
        return self._run(gm, passes, target)

    def _run(self, gm: fx.GraphModule, passes: list[GraphPass], target: BucketTarget | None) -> PassReport:
        self._started(gm, target)
        results = []
        for graph_pass in passes:
            try:
                result = graph_pass(gm)
            except BaseException:
                self._failed(gm, graph_pass, target)
                raise
            self._finished(gm, graph_pass, target)
            if result.pass_name != graph_pass.name:
                raise ValueError(f"pass {graph_pass.name!r} reported its result as {result.pass_name!r}")
            results.append(result)
        gm.graph.lint()
        gm.recompile()
        report = PassReport(tuple(results))
        self._reported(gm, report, target)
        return report

    # Hooks around each run and pass (graphs/graph_dump.py writes the graph there).

    def _started(self, gm: fx.GraphModule, target: BucketTarget | None) -> None:
        pass

    def _finished(self, gm: fx.GraphModule, graph_pass: GraphPass, target: BucketTarget | None) -> None:
        pass

    def _failed(self, gm: fx.GraphModule, graph_pass: GraphPass, target: BucketTarget | None) -> None:
        pass

    def _reported(self, gm: fx.GraphModule, report: PassReport, target: BucketTarget | None) -> None:
        pass

    def versions(self) -> dict[str, str]:
        """Each pass's name and version, in pipeline order."""
        return {p.name: p.version for p in self.pipeline}

    def version(self) -> str:
        """Readable description of everything that shapes the output graphs: each pass with
        where it applies, in order, then the op's version."""
        parts = [
            f"{'bucket:' if isinstance(p.where, PerBucket) else ''}{p.name}={p.version}"
            for p in self.pipeline
        ]
        parts.append(PAGED_ATTENTION_VERSION)
        return ";".join(parts)

    def uuid(self) -> str:
        """Stable hash of `version()`, for compile-cache keys."""
        return hashlib.sha256(self.version().encode()).hexdigest()
