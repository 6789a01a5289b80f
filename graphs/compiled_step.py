"""Inductor-compiled step graphs, one per token-count bucket, called without Dynamo.

`CompiledStep(model, kv_caches, buffers, buckets, fuse_linears=True, cache=None, ...)`:
1. with a compile-cache entry (graphs/compile_cache.py) that holds the step's calling
   convention and a bucket's artifact, loads them: no trace, no compile. The artifacts hold
   code only; their weights are rebuilt from the model by recipes (graphs/constant_recipes.py);
2. otherwise traces the step once through Dynamo (graphs/capture.py, passes included: with
   `fuse_linears`, weights frozen and q/k/v and gate/up fused into one GEMM each) on a synthetic
   step whose T, S, K and block-table width are all different and >= 2, with duck shaping
   off, so the one general graph keeps every size as its own symbol (duck shaping would tie
   equal example sizes together, and 0/1 sizes would be specialised). The synthetic step's
   slot_mapping is all -1: tracing writes only the KV cache's scratch block;
3. freezes the graph's calling convention (graphs/calling_convention.py), read after the
   passes: frozen weights are no longer inputs of the traced graph;
4. compiles per bucket, lazily on first use or up front with `compile_buckets()`, a variant of
   the graph (sharing its weights) with the per-bucket rewrites: the GEMV lowering where
   graphs/gemv_policy.py measured it to win, else oneDNN over packed weights where it measured
   that to win (graphs/passes/onednn_linear.py), the inline attention maths for decode buckets on
   CPU (graphs/passes/inline_attention.py). Static in T, S and K; the block-table width and the
   caches' block count stay symbolic (graphs/buckets.py says why). Plus once with all sizes
   dynamic for steps above the largest bucket. Each compiled graph is saved to the cache.

`__call__(inputs)` replays a captured decode graph when one serves the step
(graphs/decode_graphs.py), else pads the step in the persistent buffers (graphs/buckets.py),
builds the arguments and calls the compiled artifact directly: no guard evaluation per step.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.fx.experimental._config as fx_config
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from compiled_engine.distributed.layout import TensorParallelLayout
from compiled_engine.graphs.bucket_graphs import BUCKET_GRAPHS_VERSION, BucketGraphs
from compiled_engine.graphs.buckets import bucket_for, bucket_shape, check_buckets, pad_step
from compiled_engine.graphs.calling_convention import CallingConvention
from compiled_engine.graphs.capture import capture_model, default_pass_manager
from compiled_engine.graphs.compile_cache import CacheEntry
from compiled_engine.graphs.constant_recipes import (
    CONSTANT_RECIPES_VERSION,
    Recipe,
    build_constant,
    lifted_constant_names,
    lifted_constant_recipes,
    recipe_of,
)
from compiled_engine.graphs.decode_graphs import DecodeGraphs
from compiled_engine.graphs.device import DEVICE_RUNTIME_VERSION, DeviceRuntime, runtime_for
from compiled_engine.graphs.gemv_policy import (
    GEMV_POLICY_VERSION,
    GemvDecision,
    decide_gemv_rows,
    share_graph_module,
)
from compiled_engine.graphs.passes.freeze_parameters import FreezeParameters
from compiled_engine.graphs.passes.fuse_linears import FusedWeightCache
from compiled_engine.graphs.passes.gemv_lowering import GemvLowering
from compiled_engine.graphs.passes.inline_attention import InlineAttention
from compiled_engine.graphs.passes.onednn_linear import PackLinearWeights
from compiled_engine.graphs.standalone_compile import compile_donated, compile_with_fake_mode
from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.kernels.backends import AttentionBackend
from compiled_engine.kernels.inline_attention import INLINE_ATTENTION_VERSION
from compiled_engine.kernels.reference import REFERENCE_VERSION

logger = logging.getLogger(__name__)

# Bump when the way steps are traced, padded or called changes (it keys the compile cache).
COMPILED_STEP_VERSION = "compiled_step-3"

_STEP_RECORD = "step"
_GEMV_RECORD = "gemv"

_BLOCK_TABLES = "L['inputs'].block_tables"
_KV_CACHE = re.compile(r"L\['kv_caches'\]\[\d+\]")
_WIDTH = "L['inputs'].block_tables.size()[1]"
# The synthetic trace step: every size distinct and >= 2 (see the module docstring).
_TRACE_QUERY_LENS = (4, 5, 4)  # T = 13, S = 3
_TRACE_SAMPLED = (0, 2)  # K = 2
_TRACE_WIDTH = 5
_TRACE_TABLE_STRIDE = 7
# The dynamic graph was traced with S, K and width >= 2; steps run there are padded to at least that.
_MIN_DYNAMIC_SIZE = 2
# Room the persistent buffers need beyond the engine's limits: sequence rows to pad S and K to 2
# in the dynamic graph, and block-table columns for a width-2 bucket example whose row stride
# differs from its width (equal, the shape env would tie the stride to the width symbol and every
# narrower step would fail Inductor's stride check).
MIN_BUFFER_SEQS = 2
MIN_BUFFER_BLOCKS = 3


def _dynamic_dim1(source: str) -> bool:
    """Inputs whose dim 1 is symbolic in every bucket graph: block tables and KV caches."""
    return source == _BLOCK_TABLES or _KV_CACHE.fullmatch(source) is not None


def check_buffer_room(buffers: StepInputs) -> None:
    seqs, blocks = buffers.block_tables.shape
    if seqs < MIN_BUFFER_SEQS or blocks < MIN_BUFFER_BLOCKS:
        raise ValueError(
            f"a compiled step needs buffers with at least {MIN_BUFFER_SEQS} sequence rows and "
            f"{MIN_BUFFER_BLOCKS} block-table columns, got block_tables {seqs}x{blocks}"
        )


def _trace_inputs(device: torch.device) -> StepInputs:
    lens = torch.tensor(_TRACE_QUERY_LENS)
    num_tokens, num_seqs = int(lens.sum()), len(_TRACE_QUERY_LENS)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = lens.cumsum(0)
    positions = torch.cat([torch.arange(n) for n in _TRACE_QUERY_LENS])
    tables = torch.zeros(num_seqs, _TRACE_TABLE_STRIDE, dtype=torch.int32)
    # Full prefills: seq_len == query length (<= 5), which fits in _TRACE_WIDTH blocks of any size.
    inputs = StepInputs(
        input_ids=torch.zeros(1, num_tokens, dtype=torch.int64),
        positions=positions[None],
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        block_tables=tables[:, :_TRACE_WIDTH],
        seq_lens=lens.to(torch.int32),
        query_start_loc=query_start_loc,
        logits_indices=(query_start_loc[1:][list(_TRACE_SAMPLED)] - 1).long(),
    )
    return StepInputs(*(t.to(device) for t in inputs))


class TracedStep:
    """The one general lowered graph of a model's step, with its calling convention."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        fuse_linears: bool = True,
        attention_backend: AttentionBackend | None = None,
        tensor_parallel: TensorParallelLayout | None = None,
    ) -> None:
        recorded: list[tuple[fx.GraphModule, list[Any], CallingConvention]] = []

        def record(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            recorded.append((gm, list(example_inputs), CallingConvention.from_graph(gm)))
            return gm.forward

        # `record` runs after the passes, on the frozen graph and its kept example inputs.
        captured = capture_model(
            model,
            kv_caches,
            graph_compiler=record,
            fuse_linears=fuse_linears,
            attention_backend=attention_backend,
            tensor_parallel=tensor_parallel,
        )
        with fx_config.patch(use_duck_shape=False), torch.inference_mode():
            captured(_trace_inputs(kv_caches[0].device))
        if len(recorded) != 1:
            raise RuntimeError(f"tracing the step produced {len(recorded)} graphs, expected exactly 1")
        self.graph, self.example_inputs, self.convention = recorded[0]
        self.pass_log = captured.pass_log
        if _WIDTH not in self.convention.sources:
            raise RuntimeError("the traced graph has no block-table width input; it was specialised")


class BucketVariant(NamedTuple):
    """The per-bucket rewrites a bucket's graph got before Inductor."""

    gemv: bool = False  # linears lowered to multiply-sums (graphs/gemv_policy.py)
    inline_attention: bool = False  # attention as fused maths (graphs/passes/inline_attention.py)
    packed_linears: bool = False  # linears on oneDNN-packed weights (graphs/passes/onednn_linear.py)


@dataclass(frozen=True)
class BucketBuild:
    """How one bucket's compiled graph was obtained at start-up or first use."""

    bucket: int | None  # None: the dynamic graph
    source: str  # "compiled" (traced graph through Inductor) or "loaded" (from the compile cache)
    seconds: float
    saved: bool  # written to the compile cache
    variant: BucketVariant = BucketVariant()


def step_component_versions(
    fuse_linears: bool,
    attention_backend: AttentionBackend | None = None,
    tensor_parallel: TensorParallelLayout | None = None,
) -> dict[str, str]:
    """Versions of every piece that shapes the compiled graphs, for the compile-cache manifest."""
    passes = default_pass_manager(
        "<any>", None, FusedWeightCache() if fuse_linears else None, attention_backend, tensor_parallel
    )
    return {
        "attention_backend": attention_backend.version if attention_backend is not None else "torch",
        "compiled_step": COMPILED_STEP_VERSION,
        "passes": passes.version(),
        "freeze_parameters": FreezeParameters.version,
        "constant_recipes": CONSTANT_RECIPES_VERSION,
        "paged_attention_reference": REFERENCE_VERSION,
        "device_runtime": DEVICE_RUNTIME_VERSION,
        "bucket_graphs": BUCKET_GRAPHS_VERSION,
        "gemv_policy": f"{GEMV_POLICY_VERSION};gemv_lowering={GemvLowering.version}",
        "inline_attention": f"{InlineAttention.version};{INLINE_ATTENTION_VERSION}",
        "pack_linear_weights": PackLinearWeights.version,
    }


def _artifact_name(bucket: int | None) -> str:
    return "dynamic" if bucket is None else f"bucket-{bucket}"


class CompiledStep:
    """`__call__(StepInputs) -> logits [K, vocab]` through Inductor-compiled bucket graphs.

    `buffers`: the runner's whole persistent tensors (a StepInputs of full-size buffers, with
    the room `check_buffer_room` asks for); each step's inputs must be views at their front
    (worker/input_buffers.py), so padding is written in place behind them.
    `fuse_linears`: fuse sibling linears into one GEMM each (graphs/passes/fuse_linears.py).
    `cache`: this step's compile-cache entry (graphs/compile_cache.py), whose manifest the
    caller built for exactly these arguments. With it, start-up loads every bucket the entry
    holds and the calling convention it recorded, and traces the model only if a graph is
    missing; every graph compiled here is saved to it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        buffers: StepInputs,
        buckets: Sequence[int],
        fuse_linears: bool = True,
        cache: CacheEntry | None = None,
        runtime: DeviceRuntime | None = None,
        attention_backend: AttentionBackend | None = None,
        tensor_parallel: TensorParallelLayout | None = None,
    ) -> None:
        self.model = model
        self.attention_backend = attention_backend
        self.tensor_parallel = tensor_parallel
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.fuse_linears = fuse_linears
        self.cache = cache
        self.max_num_tokens = buffers.slot_mapping.shape[0]
        self.max_num_seqs = buffers.seq_lens.shape[0]
        self.buckets = check_buckets(buckets, self.max_num_tokens)
        check_buffer_room(buffers)
        self.traced: TracedStep | None = None
        self.num_traces = 0
        # How each bucket runs its linears: measured once per cache entry (graphs/gemv_policy.py).
        self._gemv: GemvDecision | None = None
        self.builds: dict[int | None, BucketBuild] = {}
        self._artifacts: dict[int | None, Callable[..., Any]] = {}
        # Lifted weights of loaded artifacts, by recipe: every bucket shares one fused copy.
        self._constants: dict[str, torch.Tensor] = {}
        convention = self._cached_convention()
        if convention is None:
            convention = self._trace().convention
        self.convention = convention
        self._build_args = convention.bind(model)
        if cache is not None:
            for bucket in self.all_buckets():
                loaded = self._load(bucket)
                if loaded is not None:
                    self._artifacts[bucket] = loaded
        self.runtime = runtime if runtime is not None else runtime_for(kv_caches[0].device)
        # Captured decode graphs, once capture_graphs() ran (graphs/decode_graphs.py).
        self.decode_graphs = DecodeGraphs(self, self.runtime)

    @property
    def compiled_buckets(self) -> tuple[int | None, ...]:
        return tuple(self._artifacts)

    @property
    def compile_seconds(self) -> dict[int | None, float]:
        """Seconds each bucket's graph took to compile (loaded ones are not listed)."""
        return {b: r.seconds for b, r in self.builds.items() if r.source == "compiled"}

    def all_buckets(self) -> list[int | None]:
        """Every graph this step can run: the buckets, and the dynamic one if a step can exceed them."""
        buckets: list[int | None] = list(self.buckets)
        if self.buckets[-1] < self.max_num_tokens:
            buckets.append(None)
        return buckets

    def compile_buckets(self, buckets: Sequence[int | None] | None = None) -> None:
        """Build these buckets now (default: all, and the dynamic graph if it can be reached)."""
        if buckets is None:
            buckets = self.all_buckets()
        for bucket in buckets:
            if bucket is not None and bucket not in self.buckets:
                raise ValueError(f"{bucket} is not one of the buckets {self.buckets}")
            self.artifact(bucket)

    def capture_graphs(self) -> BucketGraphs:
        """Capture a graph per decode bucket (CUDA graphs on CUDA); decode steps then replay them."""
        return self.decode_graphs.capture()

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Run on other KV-cache tensors (same layout, any block count); captured graphs are dropped."""
        for new, old in zip(kv_caches, self.kv_caches, strict=True):
            if new.shape[:1] + new.shape[2:] != old.shape[:1] + old.shape[2:] or new.dtype != old.dtype:
                raise ValueError(
                    f"KV cache layout {tuple(new.shape)} {new.dtype} does not match {tuple(old.shape)}"
                )
        self.decode_graphs.release()
        self.kv_caches = kv_caches

    def step_args(self, inputs: StepInputs) -> list[Any]:
        """The compiled graphs' positional arguments for `inputs` (views of the buffers)."""
        return self._build_args(inputs, self.kv_caches)

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        replayed = self.decode_graphs.run(inputs)
        if replayed is not None:
            return replayed
        num_tokens = inputs.slot_mapping.shape[0]
        num_logits = inputs.logits_indices.shape[0]
        bucket = bucket_for(num_tokens, self.buckets)
        if bucket is not None and num_logits > bucket_shape(bucket, self.max_num_seqs).num_seqs:
            # More logits rows than the bucket graph returns (a step with prompt logprobs): the
            # dynamic graph, whose logits-row count is its own symbol.
            bucket = None
        width = inputs.block_tables.shape[1]
        if bucket is not None:
            shape = bucket_shape(bucket, self.max_num_seqs)
            padded = pad_step(self.buffers, inputs, shape.num_tokens, shape.num_seqs, shape.num_seqs, width)
        else:
            padded = pad_step(
                self.buffers,
                inputs,
                num_tokens,
                max(inputs.seq_lens.shape[0], _MIN_DYNAMIC_SIZE),
                max(num_logits, _MIN_DYNAMIC_SIZE),
                max(width, _MIN_DYNAMIC_SIZE),
                logits_per_token=True,
            )
        artifact = self.artifact(bucket)
        with torch.no_grad():
            logits = artifact(*self._build_args(padded, self.kv_caches))[0]
        return logits[:num_logits]

    def _trace(self) -> TracedStep:
        if self.traced is None:
            self.traced = TracedStep(
                self.model, self.kv_caches, self.fuse_linears, self.attention_backend, self.tensor_parallel
            )
            self.num_traces += 1
            if self.cache is not None:
                self.cache.write_record(_STEP_RECORD, {"sources": list(self.traced.convention.sources)})
        return self.traced

    def _cached_convention(self) -> CallingConvention | None:
        if self.cache is None:
            return None
        record = self.cache.read_record(_STEP_RECORD, required=("sources",))
        if record is None:
            return None
        try:
            return CallingConvention(tuple(record["sources"]))
        except (TypeError, ValueError) as exc:
            self.cache.discard(self.cache.dir / f"{_STEP_RECORD}.json", exc)
            return None

    def artifact(self, bucket: int | None) -> Callable[..., Any]:
        """The bucket's compiled callable (None: the dynamic graph), built now if needed."""
        artifact = self._artifacts.get(bucket)
        if artifact is None:
            artifact = self._load(bucket) if self.cache is not None else None
        if artifact is None:
            start = time.perf_counter()
            compiled, recipes, variant = self._compile(bucket)
            seconds = time.perf_counter() - start
            saved = self._save(bucket, compiled, recipes, variant)
            self.builds[bucket] = BucketBuild(bucket, "compiled", seconds, saved, variant)
            artifact = compiled
        self._artifacts[bucket] = artifact
        return artifact

    def gemv_decision(self) -> GemvDecision:
        """How each bucket's graph runs its linears (GEMV lowering, oneDNN-packed or torch's GEMM):
        from the cache entry, else measured now."""
        if self._gemv is not None:
            return self._gemv
        if self.cache is not None:
            record = self.cache.read_record(_GEMV_RECORD, required=("decision",))
            if record is not None:
                try:
                    self._gemv = GemvDecision.from_json(record["decision"])
                except ValueError as exc:
                    self.cache.discard(self.cache.dir / f"{_GEMV_RECORD}.json", exc)
        if self._gemv is None:
            start = time.perf_counter()
            self._gemv = decide_gemv_rows(self._trace().graph, list(self.buckets))
            logger.info(
                "GEMV lowering for buckets %s, oneDNN-packed linears for %s%s (measured in %.1f s: %s)",
                list(self._gemv.lowered_rows),
                list(self._gemv.packed_rows),
                " and the dynamic graph" if self._gemv.packs_dynamic else "",
                time.perf_counter() - start,
                self._gemv.reason,
            )
            if self._gemv.noisy:
                # Other work competed with the timing: use the decision for this run, but do not
                # store it, so the next start (or `compiled-engine warmup`) measures again.
                logger.warning("GEMV timing was disturbed by other load; decision not cached")
            elif self.cache is not None:
                self.cache.write_record(_GEMV_RECORD, {"decision": self._gemv.to_json()})
        return self._gemv

    def inlines_attention(self, bucket: int | None) -> bool:
        """Whether `bucket`'s graph gets the inline attention maths (graphs/passes/inline_attention.py).

        On CPU, for buckets that can be decode batches (<= max_num_seqs): there the fused maths
        replaces ~40 eager calls per layer. Prefill-sized buckets keep the op, whose chunked
        matmuls suit long queries; other devices keep the op (their kernels come from it).
        """
        torch_op = self.attention_backend is None or self.attention_backend.name == "torch"
        return torch_op and bucket is not None and self.runtime.kind == "cpu" and bucket <= self.max_num_seqs

    def _bucket_graph(self, bucket: int | None) -> tuple[fx.GraphModule, BucketVariant]:
        """The graph to compile for `bucket`: a variant of the traced graph (sharing its weights)
        with the per-bucket rewrites applied, and which ones."""
        graph = self._trace().graph
        linears = self.gemv_decision()
        gemv = bucket is not None and linears.lowers(bucket)
        inline = self.inlines_attention(bucket)
        packed = not gemv and linears.packs(bucket)
        # Always a variant, even with no rewrite: the compile takes ownership of its graph.
        variant = share_graph_module(graph)
        if gemv:
            GemvLowering(max_rows=bucket, rows_hint=bucket)(variant)
        if packed:
            PackLinearWeights()(variant)
        if inline:
            InlineAttention()(variant)
        variant.graph.lint()
        variant.recompile()
        return variant, BucketVariant(gemv, inline, packed)

    def _compile(self, bucket: int | None) -> tuple[Any, list[Recipe] | str, BucketVariant]:
        """Inductor-compile `bucket`'s graph. Returns the artifact, the recipes of its lifted
        weights (or why it has none: then it cannot be saved), and its variant."""
        traced = self._trace()
        if traced.convention != self.convention:
            raise RuntimeError(
                "the model traced to a different calling convention than the compile cache recorded "
                f"for this manifest ({self.cache.dir if self.cache else '?'}); a graph-shaping option "
                "is missing from the manifest. Delete that entry to rebuild it."
            )
        graph, variant = self._bucket_graph(bucket)
        try:  # read before the compile, which owns (and may change) the graph
            recipes: list[Recipe] | str = lifted_constant_recipes(graph)
        except ValueError as exc:
            recipes = str(exc)
        # Float attributes (the attention scale) stay Python floats, as in the capture.
        with torch._dynamo.config.patch(specialize_float=True):
            if bucket is None:
                compiled = compile_donated(graph, traced.example_inputs, dynamic_shapes="from_graph")
                return compiled, recipes, variant
            # No duck shaping: a bucket's width example (2) must not be tied to an equal-sized
            # block count, or to anything else that happens to match.
            fake_mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))
            example = self._bucket_example_inputs(bucket, fake_mode)
            return compile_with_fake_mode(graph, example, fake_mode), recipes, variant

    def _save(
        self, bucket: int | None, compiled: Any, recipes: list[Recipe] | str, variant: BucketVariant
    ) -> bool:
        """Write a compiled bucket to the cache; False (and a log line) when it cannot be saved."""
        if self.cache is None:
            return False
        if isinstance(recipes, str):
            logger.info("compile cache: %s not saved: %s", _artifact_name(bucket), recipes)
            return False
        with tempfile.TemporaryDirectory(prefix="compiled-engine-save-") as tmp:
            path = os.path.join(tmp, "artifact.bin")
            compiled.save(path=path, format="binary")
            payload = Path(path).read_bytes()
        header = {"bucket": bucket, "constants": recipes, **variant._asdict()}
        self.cache.write_artifact(_artifact_name(bucket), header, payload)
        return True

    def _load(self, bucket: int | None) -> Callable[..., Any] | None:
        """The cached artifact of `bucket`, ready to call like a compiled one; None on a miss."""
        assert self.cache is not None
        name = _artifact_name(bucket)
        start = time.perf_counter()
        found = self.cache.read_artifact(name)
        if found is None:
            return None
        header, payload = found
        try:
            if header.get("bucket") != bucket:
                raise ValueError(f"header says bucket {header.get('bucket')!r}")
            constants = self._lifted_constants(header["constants"])
            with tempfile.TemporaryDirectory(prefix="compiled-engine-load-") as tmp:
                path = os.path.join(tmp, "artifact.bin")
                Path(path).write_bytes(payload)
                loaded = torch._inductor.CompiledArtifact.load(path=path, format="binary")
        except Exception as exc:  # noqa: BLE001 - any failure to load means: rebuild it
            self.cache.discard(self.cache.artifact_path(name), exc)
            return None
        seconds = time.perf_counter() - start
        variant = BucketVariant(*(bool(header.get(field)) for field in BucketVariant._fields))
        self.builds[bucket] = BucketBuild(bucket, "loaded", seconds, True, variant)

        def call_loaded(*args: Any) -> Any:
            # A loaded artifact takes the graph's lifted weights first (graphs/constant_recipes.py).
            return loaded(*constants, *args)

        return call_loaded

    def _lifted_constants(self, recipes: list[Recipe]) -> list[torch.Tensor]:
        if self.traced is not None and not self._constants:
            # Reuse the traced graph's own tensors (its fused weights) instead of a second copy.
            graph = self.traced.graph
            tensors = {**dict(graph.named_parameters()), **dict(graph.named_buffers())}
            for name in lifted_constant_names(graph):
                recipe = recipe_of(graph, name)
                if recipe is not None:
                    self._constants[repr(recipe)] = tensors[name]
        out = []
        for recipe in recipes:
            key = repr(recipe)
            if key not in self._constants:
                self._constants[key] = build_constant(recipe, self.model)
            out.append(self._constants[key])
        return out

    def _bucket_example_inputs(self, bucket: int, fake_mode: FakeTensorMode) -> list[Any]:
        """Fake arguments at the bucket's static shape, with the block-table width symbolic."""
        shape = bucket_shape(bucket, self.max_num_seqs)
        b = self.buffers
        # Width 2: 1 would be specialised away by the shape env; 2 < the row stride (>= 3).
        width = _MIN_DYNAMIC_SIZE
        views = StepInputs(
            input_ids=b.input_ids[:, : shape.num_tokens],
            positions=b.positions[:, : shape.num_tokens],
            slot_mapping=b.slot_mapping[: shape.num_tokens],
            block_tables=b.block_tables[: shape.num_seqs, :width],
            seq_lens=b.seq_lens[: shape.num_seqs],
            query_start_loc=b.query_start_loc[: shape.num_seqs + 1],
            logits_indices=b.logits_indices[: shape.num_seqs],
        )
        real = self._build_args(views, self.kv_caches)
        sources = self._traced_or_raise().convention.sources
        fakes: list[Any] = []
        symbols: dict[str, Any] = {}  # "<tensor source>.size()[1]" -> that fake's symbol
        for source, value in zip(sources, real, strict=True):
            if isinstance(value, torch.Tensor) and _dynamic_dim1(source):
                # Dim 1 stays symbolic: the block-table width, the KV caches' block count.
                dynamic = [DimDynamic.STATIC] * value.dim()
                dynamic[1] = DimDynamic.DYNAMIC
                fake = fake_mode.from_tensor(
                    value, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dynamic)
                )
                symbols[f"{source}.size()[1]"] = fake.size(1)
                fakes.append(fake)
            elif isinstance(value, torch.Tensor):
                fakes.append(fake_mode.from_tensor(value, static_shapes=True))
            else:
                fakes.append(value)
        return [symbols.get(s, f) for s, f in zip(sources, fakes, strict=True)]

    def _traced_or_raise(self) -> TracedStep:
        if self.traced is None:
            raise RuntimeError("compiling a bucket needs the traced step")
        return self.traced
