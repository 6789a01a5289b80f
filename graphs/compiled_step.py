"""Inductor-compiled step graphs, one per token-count bucket, called without Dynamo.

`CompiledStep(model, kv_caches, buffers, buckets, fuse_linears=True, cache=None, ...)` puts
the pieces together:
1. with a compile-cache entry (graphs/artifact_store.py) that holds the step's calling
   convention and a bucket's artifact, loads them: no trace, no compile. The artifacts hold
   code only; their weights are rebuilt from the model by recipes (graphs/constant_recipes.py);
2. otherwise traces the step once (graphs/traced_step.py) and freezes its calling convention;
3. builds each bucket lazily on first use, or up front with `compile_buckets()`
   (graphs/bucket_compiler.py: the traced graph's variant with its per-bucket passes, through
   Inductor), plus once with all sizes dynamic for steps above the largest bucket. Each compiled
   graph is saved to the cache, with its pass report.

`__call__(inputs)` replays a captured decode graph when one serves the step
(graphs/decode_graphs.py), else pads the step in the persistent buffers (graphs/buckets.py),
builds the arguments and calls the compiled artifact directly: no guard evaluation per step.

It is the compiled implementation of graphs/step_graph.py's `StepGraph`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from tqdm.auto import tqdm

from compiled_engine.distributed.layout import TensorParallelLayout
from compiled_engine.graphs.artifact_store import ArtifactStore, ConstantPool
from compiled_engine.graphs.background_builds import BackgroundBuilds, CompilerProcess
from compiled_engine.graphs.bucket_compiler import (
    BucketBuild,
    CompiledBucket,
    bucket_example_inputs,
    bucket_graph,
    compile_bucket,
)
from compiled_engine.graphs.bucket_graphs import BUCKET_GRAPHS_VERSION
from compiled_engine.graphs.buckets import bucket_for, bucket_shape, check_buckets, eager_shape, pad_step
from compiled_engine.graphs.compile_cache import CacheEntry
from compiled_engine.graphs.constant_recipes import CONSTANT_RECIPES_VERSION
from compiled_engine.graphs.cpu_step_plan import CpuStepPlan
from compiled_engine.graphs.decode_graphs import DEFAULT_MAX_PLAN_TOKENS, DecodeGraphs
from compiled_engine.graphs.device import DEVICE_RUNTIME_VERSION, CpuGraph, DeviceRuntime, runtime_for
from compiled_engine.graphs.gemv_policy import GEMV_POLICY_VERSION, GemvDecision, decide_gemv_rows
from compiled_engine.graphs.pass_manager import BucketTarget, PassReport, PerBucket
from compiled_engine.graphs.pass_pipeline import default_pass_manager
from compiled_engine.graphs.passes.fuse_linears import FusedWeightCache
from compiled_engine.graphs.quantized_gemv_policy import QUANTIZED_GEMV_POLICY_VERSION, with_quantized_rows
from compiled_engine.graphs.step_inputs import FrontViews, StepInputs
from compiled_engine.graphs.traced_step import MIN_DYNAMIC_SIZE, TracedStep, check_buffer_room
from compiled_engine.kernels.backends import AttentionBackend
from compiled_engine.kernels.paged_attention import PAGED_ATTENTION_VERSION
from compiled_engine.kernels.reference import REFERENCE_VERSION
from compiled_engine.kernels.source_version import source_version
from compiled_engine.records.graph_status import EAGER, GraphCall, GraphStatus, graph_label
from compiled_engine.records.weight_quantization import WeightQuantization

logger = logging.getLogger(__name__)

# The way steps are traced, padded, compiled, cached and called: every module on that path.
COMPILED_STEP_VERSION = source_version(
    __name__,
    "compiled_engine.graphs.traced_step",
    "compiled_engine.graphs.bucket_compiler",
    "compiled_engine.graphs.artifact_store",
    "compiled_engine.graphs.decode_graphs",
    "compiled_engine.graphs.buckets",
    "compiled_engine.graphs.calling_convention",
    "compiled_engine.graphs.capture",
    "compiled_engine.graphs.attention_interface",
    "compiled_engine.graphs.step_inputs",
    "compiled_engine.graphs.standalone_compile",
    "compiled_engine.graphs.pass_manager",
)

# engine_args.py COMPILE_POLICY_CHOICES (a test keeps the two equal; graphs/ does not import it).
COMPILE_POLICIES = ("background", "blocking", "ahead")


def step_component_versions(
    fuse_linears: bool,
    attention_backend: AttentionBackend | None = None,
    tensor_parallel: TensorParallelLayout | None = None,
    quantization: WeightQuantization | None = None,
) -> dict[str, str]:
    """Versions of every piece that shapes the compiled graphs, for the compile-cache manifest:
    each a hash of its source (kernels/source_version.py), one field per pass, so a miss names
    the piece that changed."""
    passes = default_pass_manager(
        "<any>",
        None,
        FusedWeightCache() if fuse_linears else None,
        attention_backend,
        tensor_parallel,
        quantization=quantization,
    )
    return {
        "attention_backend": attention_backend.version if attention_backend is not None else "torch",
        "compiled_step": COMPILED_STEP_VERSION,
        # The pipeline's order (capture passes, then bucket:...), then each pass's own version.
        "passes": ",".join(
            f"{'bucket:' if isinstance(entry.where, PerBucket) else ''}{entry.name}"
            for entry in passes.pipeline
        ),
        **{f"pass.{name}": version for name, version in passes.versions().items()},
        "paged_attention": PAGED_ATTENTION_VERSION,
        "paged_attention_reference": REFERENCE_VERSION,
        "constant_recipes": CONSTANT_RECIPES_VERSION,
        "device_runtime": DEVICE_RUNTIME_VERSION,
        "bucket_graphs": BUCKET_GRAPHS_VERSION,
        "gemv_policy": GEMV_POLICY_VERSION,
        "quantized_gemv_policy": QUANTIZED_GEMV_POLICY_VERSION,
    }


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
    `policy`: what a step does when its bucket is not built yet (engine_args.py
    COMPILE_POLICY_CHOICES). "blocking": build it first; "ahead": every graph is built here,
    before the first step; "background": `compiler` (graphs/background_builds.py) compiles the
    missing graphs in another process while steps run on a fallback graph — the smallest ready
    bucket that holds the step, else the dynamic graph, else the traced graph run eagerly — and
    a compiled graph is swapped in between steps once loaded.
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
        quantization: WeightQuantization | None = None,
        policy: str = "blocking",
        compiler: CompilerProcess | None = None,
        before_inductor: Callable[[], None] | None = None,
        max_plan_tokens: int = DEFAULT_MAX_PLAN_TOKENS,
    ) -> None:
        if policy not in COMPILE_POLICIES:
            raise ValueError(
                f"unknown compile policy {policy!r}: choose one of {', '.join(COMPILE_POLICIES)}"
            )
        if policy == "background" and (compiler is None or cache is None):
            raise ValueError("the background compile policy needs a compiler process and a compile cache")
        self.model = model
        self.policy = policy
        # Called before Inductor first runs here (graphs/inductor_warmup.py: its CPU probes).
        self._before_inductor = before_inductor or (lambda: None)
        self.attention_backend = attention_backend
        self.tensor_parallel = tensor_parallel
        self.quantization = quantization
        self.kv_caches = kv_caches
        self.buffers = buffers
        self._padded = FrontViews(buffers)  # the padded steps' views
        self.fuse_linears = fuse_linears
        self.cache_entry = cache
        self.store = ArtifactStore(cache) if cache is not None else None
        self.max_num_tokens = buffers.slot_mapping.shape[0]
        self.max_num_seqs = buffers.seq_lens.shape[0]
        self.buckets = check_buckets(buckets, self.max_num_tokens)
        check_buffer_room(buffers)
        self.runtime = runtime if runtime is not None else runtime_for(kv_caches[0].device)
        self.traced: TracedStep | None = None
        self.num_traces = 0
        # How each bucket runs its linears: measured once per cache entry (graphs/gemv_policy.py).
        self._gemv: GemvDecision | None = None
        self.builds: dict[int | None, BucketBuild] = {}
        self._artifacts: dict[int | None, Callable[..., Any]] = {}
        self._constants = ConstantPool(model)
        convention = self.store.read_convention() if self.store is not None else None
        if convention is None:
            convention = self._trace().convention
        self.convention = convention
        self._build_args = convention.bind(model)
        # Captured decode graphs, once capture_graphs() ran, or (CPU) each when a decode step first
        # finds its bucket compiled (graphs/decode_graphs.py).
        self.decode_graphs = DecodeGraphs(self.runtime, buffers, self.buckets, self.max_num_seqs)
        self.decode_graphs.capture_on_demand(self._artifacts.get, self.step_args, max_plan_tokens)
        self.last_call: GraphCall | None = None  # how the latest step ran
        self.background: BackgroundBuilds | None = None
        if self.store is not None:
            # Every graph the cache holds, now: a warm engine never loads on the request path.
            cached = [b for b in self.all_buckets() if self.store.has(b)]
            for bucket in tqdm(cached, desc="Loading graphs", unit="graph", disable=None):
                loaded = self._load(bucket)
                if loaded is not None:
                    self._artifacts[bucket] = loaded
        missing = [b for b in self.all_buckets() if b not in self._artifacts]
        if missing and policy == "ahead":
            self.compile_buckets(missing, show_progress=None)
        elif missing and policy == "background":
            assert compiler is not None and self.store is not None
            if None not in self._artifacts:
                # The eager fallback runs the traced graph (its weights are the loaded graphs'
                # too): traced now, not on a step. With the dynamic graph loaded, every step has
                # a compiled fallback and nothing is traced.
                self._trace()
            # A weak hold on this step: its background threads must not keep the model alive.
            load_weakly = weakref.WeakMethod(self._load)
            self.background = BackgroundBuilds(
                compiler,
                background_order(missing),
                str(self.store.entry.dir),
                lambda bucket: (load := load_weakly()) and load(bucket),
            )

    # The StepGraph protocol (graphs/step_graph.py).

    @property
    def supports_graphs(self) -> bool:
        return self.runtime.supports_graphs

    def capture_graphs(self) -> int:
        """Capture a graph per decode bucket (CUDA graphs on CUDA); decode steps then replay them.
        Returns the bytes they hold on the device."""
        return self.decode_graphs.capture(self.artifact, self.step_args).memory_bytes

    def release_graphs(self) -> None:
        """Drop the captured graphs (their memory returns to the device allocator)."""
        self.decode_graphs.release()

    def decode_plan(self, num_tokens: int) -> CpuStepPlan | None:
        graphs = self.decode_graphs.graphs
        bucket = bucket_for(num_tokens, self.buckets)
        graph = graphs.graph(bucket) if graphs is not None and bucket is not None else None
        return graph.plan if isinstance(graph, CpuGraph) else None

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Run on other KV-cache tensors (same layout, any block count); captured graphs are dropped."""
        for new, old in zip(kv_caches, self.kv_caches, strict=True):
            if new.shape[:1] + new.shape[2:] != old.shape[:1] + old.shape[2:] or new.dtype != old.dtype:
                raise ValueError(
                    f"KV cache layout {tuple(new.shape)} {new.dtype} does not match {tuple(old.shape)}"
                )
        self.decode_graphs.release()
        self.kv_caches = kv_caches

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

    def compile_buckets(
        self, buckets: Sequence[int | None] | None = None, show_progress: bool | None = False
    ) -> None:
        """Build these buckets now (default: all, and the dynamic graph if it can be reached).
        `show_progress`: a progress bar always (True), on a terminal only (None), or never."""
        if buckets is None:
            buckets = self.all_buckets()
        for bucket in buckets:
            if bucket is not None and bucket not in self.buckets:
                raise ValueError(f"{bucket} is not one of the buckets {self.buckets}")
        disable = None if show_progress is None else not show_progress
        with tqdm(total=len(buckets), desc="Building graphs", unit="graph", disable=disable) as bar:
            for bucket in buckets:
                bar.set_postfix_str(graph_label(bucket))
                self.artifact(bucket)
                bar.update(1)

    def status(self) -> GraphStatus:
        """How many of its graphs are ready, compiling, failed (records/graph_status.py)."""
        total = len(self.all_buckets())
        artifacts = list(self._artifacts)  # one copy: the server reads this from another thread
        if self.background is None:
            return GraphStatus(
                total=total, ready=len(artifacts), on_demand=total - len(artifacts), policy=self.policy
            )
        background = self.background
        ready_elsewhere = sum(1 for b in artifacts if background.state(b) is None)
        return background.status(total, ready_elsewhere, self.policy)

    def close(self) -> None:
        """Stop the background compiler, if one runs (what it compiled stays in the cache)."""
        if self.background is not None:
            self.background.close()

    def step_args(self, inputs: StepInputs) -> list[Any]:
        """The compiled graphs' positional arguments for `inputs` (views of the buffers)."""
        return self._build_args(inputs, self.kv_caches)

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        with self._sharing_cores():
            replayed = self.decode_graphs.run(inputs)
        num_tokens = inputs.slot_mapping.shape[0]
        num_logits = inputs.logits_indices.shape[0]
        if replayed is not None:
            label = graph_label(bucket_for(num_tokens, self.buckets))
            self.last_call = GraphCall(label, label)
            return replayed
        if self.background is not None:
            for ready, artifact in self.background.take_ready():  # between steps: swap them in
                self._artifacts[ready] = artifact
        wanted = self._bucket_of(num_tokens, num_logits)
        graph: int | str | None = wanted
        waited, wait_s = None, 0.0
        if wanted not in self._artifacts:
            if self.background is not None and self.background.state(wanted) is not None:
                self.background.request(wanted)  # loads it off this thread once it is compiled
                graph = self._fallback(num_tokens, num_logits)
            else:
                started = time.perf_counter()
                self.artifact(wanted)
                wait_s = time.perf_counter() - started
                waited = "compile" if self.builds[wanted].source == "compiled" else "load"
        ran = graph if isinstance(graph, str) else graph_label(graph)
        self.last_call = GraphCall(graph_label(wanted), ran, waited, wait_s)
        width = inputs.block_tables.shape[1]
        # The eager fallback runs at its bucket's shape too: a cold engine's steps then show the
        # eager ops a dozen shapes, not one per token count, so their per-shape set-up (oneDNN
        # primitives, allocator growth) is paid a dozen times, not at every new step size.
        if graph == EAGER and isinstance(wanted, int):
            tokens, seqs, logits = eager_shape(
                num_tokens, inputs.seq_lens.shape[0], num_logits, self.buckets, self.max_num_seqs
            )
            padded = pad_step(self.buffers, inputs, tokens, seqs, logits, width, views=self._padded)
        elif isinstance(graph, int):
            shape = bucket_shape(graph, self.max_num_seqs)
            tokens, seqs = shape.num_tokens, shape.num_seqs
            padded = pad_step(self.buffers, inputs, tokens, seqs, seqs, width, views=self._padded)
        else:
            padded = pad_step(
                self.buffers,
                inputs,
                num_tokens,
                max(inputs.seq_lens.shape[0], MIN_DYNAMIC_SIZE),
                max(num_logits, MIN_DYNAMIC_SIZE),
                max(width, MIN_DYNAMIC_SIZE),
                logits_per_token=True,
            )
        run = self._run_eager if graph == EAGER else self._artifacts[graph]  # type: ignore[index]
        with torch.no_grad(), self._sharing_cores():
            logits = run(*self._build_args(padded, self.kv_caches))[0]
        return logits[:num_logits]

    @contextlib.contextmanager
    def _sharing_cores(self) -> Iterator[None]:
        """While the compiler process runs, a step on the CPU uses one thread fewer: the compiler
        then has a core of its own instead of preempting one of the step's threads, which every
        op of the step would wait for (docs/performance.md measures it on 2 cores). Set and put
        back around each step, on the thread that runs it (torch's count is per thread)."""
        threads = torch.get_num_threads()
        share = (
            self.background is not None
            and self.background.running
            and self.runtime.kind == "cpu"
            and threads > 1
        )
        if share:
            torch.set_num_threads(threads - 1)
        try:
            yield
        finally:
            if share:
                torch.set_num_threads(threads)

    def _bucket_of(self, num_tokens: int, num_logits: int) -> int | None:
        """The graph a step of this size belongs in: its bucket, or None (the dynamic graph)."""
        bucket = bucket_for(num_tokens, self.buckets)
        if bucket is not None and num_logits > bucket_shape(bucket, self.max_num_seqs).num_seqs:
            # More logits rows than the bucket graph returns (a step with prompt logprobs): the
            # dynamic graph, whose logits-row count is its own symbol.
            return None
        return bucket

    def _fallback(self, num_tokens: int, num_logits: int) -> int | str | None:
        """A ready graph for a step whose own is not: the smallest larger bucket that holds it,
        else the dynamic graph, else EAGER (the traced graph, run as it is)."""
        for bucket in self.buckets:
            if (
                bucket >= num_tokens
                and bucket in self._artifacts
                and num_logits <= bucket_shape(bucket, self.max_num_seqs).num_seqs
            ):
                return bucket
        return None if None in self._artifacts else EAGER

    def _run_eager(self, *args: Any) -> Any:
        return self._trace().graph(*args)

    def artifact(self, bucket: int | None) -> Callable[..., Any]:
        """The bucket's compiled callable (None: the dynamic graph), built now if needed."""
        artifact = self._artifacts.get(bucket)
        if artifact is None:
            artifact = self._load(bucket) if self.store is not None else None
        if artifact is None:
            start = time.perf_counter()
            compiled = self._compile(bucket)
            seconds = time.perf_counter() - start
            saved = self.store is not None and self.store.save(
                bucket, compiled.artifact, compiled.recipes, compiled.passes
            )
            self.builds[bucket] = BucketBuild(bucket, "compiled", seconds, saved, compiled.passes)
            artifact = compiled.artifact
        self._artifacts[bucket] = artifact
        return artifact

    def gemv_decision(self) -> GemvDecision:
        """How each bucket's graph runs its linears (GEMV lowering, oneDNN-packed or torch's GEMM):
        from the cache entry, else measured now."""
        if self._gemv is not None:
            return self._gemv
        if self.store is not None:
            self._gemv = self.store.read_gemv_decision()
        if self._gemv is None:
            self._before_inductor()  # the timing compiles with Inductor
            start = time.perf_counter()
            graph = self._trace().graph
            self._gemv = with_quantized_rows(decide_gemv_rows(graph, list(self.buckets)), graph, self.buckets)
            logger.info(
                "GEMV lowering for buckets %s, C++ GEMV for %s (quantized linears: %s, their tile path: %s), "
                "oneDNN-packed linears for %s%s, widened fp32 linears for %s%s (measured in %.1f s: %s)",
                list(self._gemv.lowered_rows),
                list(self._gemv.kernel_rows),
                list(self._gemv.quantized_kernel_rows),
                list(self._gemv.quantized_tile_rows),
                list(self._gemv.packed_rows),
                " and the dynamic graph" if self._gemv.packs_dynamic else "",
                list(self._gemv.widened_rows),
                " and the dynamic graph" if self._gemv.widens_dynamic else "",
                time.perf_counter() - start,
                self._gemv.reason,
            )
            if self._gemv.noisy:
                # Other work competed with the timing: use the decision for this run, but do not
                # store it, so the next start (or `compiled-engine warmup`) measures again.
                logger.warning("GEMV timing was disturbed by other load; decision not cached")
            elif self.store is not None:
                self.store.write_gemv_decision(self._gemv)
        return self._gemv

    def bucket_target(self, bucket: int | None) -> BucketTarget:
        """What the per-bucket passes decide on for `bucket` (graphs/pass_pipeline.py)."""
        backend = self.attention_backend.name if self.attention_backend is not None else "torch"
        return BucketTarget(bucket, self.max_num_seqs, self.runtime.kind, backend, self.gemv_decision())

    def bucket_graph(self, bucket: int | None) -> tuple[fx.GraphModule, PassReport]:
        """The graph `bucket` would compile (a variant of the traced graph, sharing its weights)
        and the report of its per-bucket passes."""
        return bucket_graph(self._trace(), self.bucket_target(bucket))

    def _trace(self) -> TracedStep:
        if self.traced is None:
            self.traced = TracedStep(
                self.model,
                self.kv_caches,
                self.fuse_linears,
                self.attention_backend,
                self.tensor_parallel,
                self.quantization,
            )
            self.num_traces += 1
            if self.store is not None:
                self.store.write_convention(self.traced.convention)
        return self.traced

    def _compile(self, bucket: int | None) -> CompiledBucket:
        self._before_inductor()
        traced = self._trace()
        if traced.convention != self.convention:
            raise RuntimeError(
                "the model traced to a different calling convention than the compile cache recorded "
                f"for this manifest ({self.cache_entry.dir if self.cache_entry else '?'}); a graph-shaping "
                "option is missing from the manifest. Delete that entry to rebuild it."
            )
        return compile_bucket(traced, self.bucket_target(bucket), self._example_inputs)

    def _example_inputs(self, bucket: int, fake_mode: FakeTensorMode) -> list[Any]:
        sources = self.convention.sources
        return bucket_example_inputs(
            bucket, fake_mode, self.buffers, self.max_num_seqs, sources, self.step_args
        )

    def _load(self, bucket: int | None) -> Callable[..., Any] | None:
        """The cached artifact of `bucket`, ready to call like a compiled one; None on a miss."""
        assert self.store is not None
        self._before_inductor()
        start = time.perf_counter()
        if self.traced is not None:
            # Reuse the traced graph's own tensors (its fused weights) instead of a second copy.
            self._constants.adopt(self.traced.graph)
        loaded = self.store.load(bucket, self._constants.tensors)
        if loaded is None:
            return None
        seconds = time.perf_counter() - start
        self.builds[bucket] = BucketBuild(bucket, "loaded", seconds, True, loaded.passes)
        return loaded.run


def background_order(buckets: Sequence[int | None]) -> list[int | None]:
    """The order the background compiler builds `buckets` in: first the one graph that serves
    every step size (the dynamic graph, else the largest bucket), then the rest smallest first,
    as small steps (decodes) are the most frequent."""
    first = None if None in buckets else max(b for b in buckets if b is not None)
    return [first] + sorted(b for b in buckets if b is not None and b != first)
