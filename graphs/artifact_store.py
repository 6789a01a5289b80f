"""What a compiled step keeps in its compile-cache entry, and how it reads it back.

Three kinds of things, in one `CacheEntry` (graphs/compile_cache.py, which owns the file
safety rules: atomic writes, checksums, a bad file removed and rebuilt):

- `step.json`: the traced graph's calling convention (graphs/calling_convention.py), so a warm
  start binds its arguments without tracing;
- `gemv.json`: the GEMV policy's decision (graphs/gemv_policy.py), so it is measured once;
- `bucket-<rows>.artifact` / `dynamic.artifact`: one compiled graph each. The header holds the
  bucket, the recipes of the graph's lifted weights (artifacts hold code, not weights:
  graphs/constant_recipes.py) and the report of the per-bucket passes its graph got, so a
  loaded bucket says what it is; the payload is Inductor's saved artifact.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

from compiled_engine.graphs.calling_convention import CallingConvention
from compiled_engine.graphs.compile_cache import CacheEntry
from compiled_engine.graphs.constant_recipes import Recipe, build_constant, lifted_constant_names, recipe_of
from compiled_engine.graphs.gemv_policy import GemvDecision
from compiled_engine.graphs.graph_dump import bucket_label
from compiled_engine.graphs.pass_manager import PassReport
from compiled_engine.kernels.weight_quantization import QuantizedWeight

logger = logging.getLogger(__name__)

_STEP_RECORD = "step"
_GEMV_RECORD = "gemv"


@dataclass(frozen=True)
class LoadedBucket:
    """A bucket's artifact read from the cache, ready to call like a freshly compiled one."""

    run: Callable[..., Any]
    passes: PassReport  # the per-bucket passes its graph got when it was compiled


class ConstantPool:
    """Lifted weights of loaded artifacts, by recipe: every bucket shares one copy of each."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._tensors: dict[str, torch.Tensor] = {}
        # Each quantized weight once, whichever of its parts a recipe asks for first.
        self._quantized: dict[str, QuantizedWeight] = {}

    def adopt(self, graph: fx.GraphModule) -> None:
        """Reuse a traced graph's own tensors (its fused weights) instead of building copies."""
        if self._tensors:
            return
        tensors = {**dict(graph.named_parameters()), **dict(graph.named_buffers())}
        for name in lifted_constant_names(graph):
            recipe = recipe_of(graph, name)
            if recipe is not None:
                self._tensors[repr(recipe)] = tensors[name]

    def tensors(self, recipes: list[Recipe]) -> list[torch.Tensor]:
        out = []
        for recipe in recipes:
            key = repr(recipe)
            if key not in self._tensors:
                self._tensors[key] = build_constant(recipe, self.model, self._quantized)
            out.append(self._tensors[key])
        return out


class ArtifactStore:
    """A compiled step's records and bucket artifacts in one compile-cache entry."""

    def __init__(self, entry: CacheEntry) -> None:
        self.entry = entry

    def read_convention(self) -> CallingConvention | None:
        record = self.entry.read_record(_STEP_RECORD, required=("sources",))
        if record is None:
            return None
        try:
            return CallingConvention(tuple(record["sources"]))
        except (TypeError, ValueError) as exc:
            self.entry.discard(self.entry.dir / f"{_STEP_RECORD}.json", exc)
            return None

    def write_convention(self, convention: CallingConvention) -> None:
        self.entry.write_record(_STEP_RECORD, {"sources": list(convention.sources)})

    def read_gemv_decision(self) -> GemvDecision | None:
        record = self.entry.read_record(_GEMV_RECORD, required=("decision",))
        if record is None:
            return None
        try:
            return GemvDecision.from_json(record["decision"])
        except ValueError as exc:
            self.entry.discard(self.entry.dir / f"{_GEMV_RECORD}.json", exc)
            return None

    def write_gemv_decision(self, decision: GemvDecision) -> None:
        self.entry.write_record(_GEMV_RECORD, {"decision": decision.to_json()})

    def save(
        self, bucket: int | None, compiled: Any, recipes: list[Recipe] | str, passes: PassReport
    ) -> bool:
        """Write a compiled bucket; False (and a log line) when it cannot be saved.

        `recipes`: how to rebuild the graph's lifted weights, or why there are none (a string).
        """
        name = bucket_label(bucket)
        if isinstance(recipes, str):
            logger.info("compile cache: %s not saved: %s", name, recipes)
            return False
        with tempfile.TemporaryDirectory(prefix="compiled-engine-save-") as tmp:
            path = os.path.join(tmp, "artifact.bin")
            compiled.save(path=path, format="binary")
            payload = Path(path).read_bytes()
        header = {"bucket": bucket, "constants": recipes, "passes": passes.to_json()}
        self.entry.write_artifact(name, header, payload)
        return True

    def has(self, bucket: int | None) -> bool:
        """Whether the entry holds an artifact for `bucket` (not yet checked: `load` does that)."""
        return self.entry.artifact_path(bucket_label(bucket)).is_file()

    def load(
        self, bucket: int | None, constants: Callable[[list[Recipe]], list[torch.Tensor]]
    ) -> LoadedBucket | None:
        """The cached artifact of `bucket`, its weights from `constants(recipes)`; None on a miss.
        An artifact that fails to load is reported and removed, so the caller rebuilds it."""
        name = bucket_label(bucket)
        found = self.entry.read_artifact(name)
        if found is None:
            return None
        header, payload = found
        try:
            if header.get("bucket") != bucket:
                raise ValueError(f"header says bucket {header.get('bucket')!r}")
            passes = PassReport.from_json(header["passes"])
            lifted = constants(header["constants"])
            with tempfile.TemporaryDirectory(prefix="compiled-engine-load-") as tmp:
                path = os.path.join(tmp, "artifact.bin")
                Path(path).write_bytes(payload)
                loaded = torch._inductor.CompiledArtifact.load(path=path, format="binary")
        except Exception as exc:  # noqa: BLE001 - any failure to load means: rebuild it
            self.entry.discard(self.entry.artifact_path(name), exc)
            return None

        def call_loaded(*args: Any) -> Any:
            # A loaded artifact takes the graph's lifted weights first (graphs/constant_recipes.py).
            return loaded(*lifted, *args)

        return LoadedBucket(call_loaded, passes)
