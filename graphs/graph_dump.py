"""Write captured graphs to disk as readable Python, before and after each pass.

Why: when a pass rewrites the wrong node, or a model traces differently than expected, the
quickest answer is to read the graph at each stage. Set `COMPILED_ENGINE_DUMP_GRAPHS=DIR`
and every graph a `DumpingPassManager` processes lands in `DIR/<graph-id>/`:

    00-captured.py                  the graph Dynamo handed the backend
    01-after-freeze_parameters.py   ... one file per capture-time pass, in order
    02-after-lower_sdpa.py
    bucket-4/00-traced.py           a bucket's variant of the traced graph (graphs/bucket_compiler.py)
    bucket-4/01-after-gemv_lowering.py   ... one file per pass that applied to that bucket
    dynamic/00-traced.py            the dynamic graph above the largest bucket

    bucket-4/passes.txt             the bucket's pass report: each pass's nodes rewritten and notes

`<graph-id>` is Dynamo's backend id for the graph (unique per compiled graph, so graphs of
several models or shape specialisations never overwrite each other), else a name made from
the object's id.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

from torch import fx

from compiled_engine.graphs.pass_manager import (
    BucketTarget,
    GraphPass,
    PassManager,
    PassReport,
    PipelinePass,
)

DUMP_DIR_ENV = "COMPILED_ENGINE_DUMP_GRAPHS"
REPORT_FILE = "passes.txt"


def dump_dir_from_env() -> Path | None:
    """The directory named by COMPILED_ENGINE_DUMP_GRAPHS, or None when it is unset or empty."""
    value = os.environ.get(DUMP_DIR_ENV, "").strip()
    return Path(value) if value else None


def graph_id(gm: fx.GraphModule) -> str:
    """A file-system-safe name for `gm`, stable for the graph's lifetime."""
    raw = str(gm.meta.get("backend_id") or f"graph-{id(gm):x}")
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)


def _readable(gm: fx.GraphModule) -> str:
    # Generated from the graph itself, so it is current even before gm.recompile().
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


def bucket_label(bucket: int | None) -> str:
    """How a bucket graph is named in dumps and the compile cache: `bucket-<rows>` or `dynamic`."""
    return "dynamic" if bucket is None else f"bucket-{bucket}"


def dump_graph(gm: fx.GraphModule, stage: str, directory: str | Path, subdir: str | None = None) -> Path:
    """Write `gm` as `directory/<graph-id>[/<subdir>]/<NN>-<stage>.py`, NN counting that
    folder's dumps (`subdir`: a bucket's variant graph, under the graph it was made from)."""
    if not stage or any(c in stage for c in "/\\"):
        raise ValueError(f"dump stage must be a non-empty name without path separators, got {stage!r}")
    graph_dir = Path(directory) / graph_id(gm)
    if subdir is not None:
        graph_dir /= subdir
    graph_dir.mkdir(parents=True, exist_ok=True)
    number = sum(1 for p in graph_dir.iterdir() if p.suffix == ".py")
    path = graph_dir / f"{number:02d}-{stage}.py"
    path.write_text(_readable(gm), encoding="utf-8")
    return path


class DumpingPassManager(PassManager):
    """A PassManager that also dumps the graph before the first pass and after each one.

    With `dump_dir=None` it behaves exactly like PassManager. Same `version()`/`uuid()`:
    dumping does not change the graphs, so it must not change compile-cache keys.
    """

    def __init__(self, passes: Sequence[GraphPass | PipelinePass], dump_dir: str | Path | None) -> None:
        super().__init__(passes)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None

    def _dump(self, gm: fx.GraphModule, stage: str, target: BucketTarget | None) -> None:
        if self.dump_dir is not None:
            dump_graph(gm, stage, self.dump_dir, None if target is None else bucket_label(target.bucket))

    def _started(self, gm: fx.GraphModule, target: BucketTarget | None) -> None:
        self._dump(gm, "captured" if target is None else "traced", target)

    def _finished(self, gm: fx.GraphModule, graph_pass: GraphPass, target: BucketTarget | None) -> None:
        self._dump(gm, f"after-{graph_pass.name}", target)

    def _failed(self, gm: fx.GraphModule, graph_pass: GraphPass, target: BucketTarget | None) -> None:
        # The half-rewritten graph explains the error; never let dumping mask it.
        with contextlib.suppress(Exception):
            self._dump(gm, f"failed-in-{graph_pass.name}", target)

    def _reported(self, gm: fx.GraphModule, report: PassReport, target: BucketTarget | None) -> None:
        # A bucket's folder also gets its pass report (nodes rewritten, notes): the per-bucket
        # passes are chosen per bucket, so which ran, and what they did, is worth a file.
        if self.dump_dir is not None and target is not None:
            folder = self.dump_dir / graph_id(gm) / bucket_label(target.bucket)
            folder.mkdir(parents=True, exist_ok=True)
            summary = report.summary() or "no per-bucket pass applied"
            (folder / REPORT_FILE).write_text(summary, encoding="utf-8")
