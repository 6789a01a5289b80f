"""The one step protocol the model runner sees, its two implementations, and the factory.

`StepGraph`: `__call__(StepInputs) -> logits`, the device `runtime`, decode-graph capture and
release, a KV-cache swap, and what `compiled-engine warmup` reads (buckets, builds, the
cache entry). Two implementations:

- `CompiledStep` (graphs/compiled_step.py, the default): Inductor graphs per token-count
  bucket, called directly, cached on disk, decode graphs captured on CUDA;
- `EagerStepGraph` (`enforce_eager=True`): the lowered graphs run as they are, through
  Dynamo's frame (guards every step). Never fused: its graphs are for debugging and stay
  one-to-one with the model's modules. No buckets, no cache, no decode graphs; it keeps the
  KV caches it was captured with.

`build_step_graph(...)` builds the right one from the options, once; the runner never asks
which it got.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.distributed.layout import TensorParallelLayout
from compiled_engine.distributed.pipeline_stages import pipeline_stage_of
from compiled_engine.graphs.background_builds import CompilerProcess
from compiled_engine.graphs.bucket_compiler import BucketBuild
from compiled_engine.graphs.buckets import default_buckets
from compiled_engine.graphs.capture import CapturedModel, capture_model
from compiled_engine.graphs.compile_cache import CacheEntry, CompileCache
from compiled_engine.graphs.compile_manifest import GraphOptions, Manifest, build_manifest
from compiled_engine.graphs.compiled_step import CompiledStep, step_component_versions
from compiled_engine.graphs.cpu_step_plan import CpuStepPlan
from compiled_engine.graphs.device import DeviceRuntime, runtime_for
from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.kernels.backends import AttentionBackend
from compiled_engine.records.graph_status import EAGER, GraphCall, GraphStatus

logger = logging.getLogger(__name__)


class StepGraph(Protocol):
    """A model's forward step as the runner calls it."""

    runtime: DeviceRuntime
    attention_backend: AttentionBackend | None
    cache_entry: CacheEntry | None  # the compile-cache entry its graphs live in, if any
    builds: dict[int | None, BucketBuild]  # how each bucket graph was obtained so far
    last_call: GraphCall | None  # how the latest step ran: its graph, a fallback, a wait

    def __call__(self, inputs: StepInputs) -> torch.Tensor: ...

    def status(self) -> GraphStatus:
        """How many of its graphs are ready, compiling, failed."""
        ...

    def close(self) -> None:
        """Stop anything it runs in the background."""
        ...

    @property
    def supports_graphs(self) -> bool:
        """Whether decode graphs are worth capturing (compiled graphs on a device with graphs)."""
        ...

    def capture_graphs(self) -> int:
        """Capture the decode graphs; returns the bytes they hold on the device."""
        ...

    def release_graphs(self) -> None: ...

    def decode_plan(self, num_tokens: int) -> CpuStepPlan | None:
        """The recorded CPU plan a decode step of `num_tokens` rows replays (graphs/cpu_step_plan.py),
        once one ran; None: no plan serves it (multi-step runs then go through `__call__`)."""
        ...

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Run on other KV-cache tensors of the same layout."""
        ...

    def all_buckets(self) -> list[int | None]:
        """Every bucket graph it can run (None: the dynamic graph)."""
        ...

    def compile_buckets(
        self, buckets: Sequence[int | None] | None = None, show_progress: bool | None = False
    ) -> None:
        """Build (load or compile) these bucket graphs now; default all."""
        ...


class EagerStepGraph:
    """The captured graphs run through Dynamo's frame, as lowered (enforce_eager=True)."""

    cache_entry: CacheEntry | None = None
    supports_graphs = False
    last_call: GraphCall | None = GraphCall(EAGER, EAGER)

    def __init__(self, captured: CapturedModel, runtime: DeviceRuntime, attention_backend: AttentionBackend):
        self.captured = captured
        self.runtime = runtime
        self.attention_backend: AttentionBackend | None = attention_backend
        self.builds: dict[int | None, BucketBuild] = {}

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        return self.captured(inputs)

    def capture_graphs(self) -> int:
        return 0

    def release_graphs(self) -> None:
        pass

    def decode_plan(self, num_tokens: int) -> CpuStepPlan | None:
        return None  # nothing is compiled, so nothing is recorded

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        raise RuntimeError("the eager path keeps the KV caches it was captured with")

    def all_buckets(self) -> list[int | None]:
        return []

    def compile_buckets(
        self, buckets: Sequence[int | None] | None = None, show_progress: bool | None = False
    ) -> None:
        if buckets:
            raise ValueError("the eager path has no bucket graphs")

    def status(self) -> GraphStatus:
        return GraphStatus(policy=EAGER)

    def close(self) -> None:
        pass


def build_step_graph(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    buffers: StepInputs,
    config: EngineConfig,
    *,
    cache: CompileCache | None,
    attention_backend: AttentionBackend,
    tensor_parallel: TensorParallelLayout | None,
    compiler: CompilerProcess | None = None,
    before_inductor: Callable[[], None] | None = None,
) -> StepGraph:
    """The step graph `config` asks for (enforce_eager, the buckets, fuse_linears, the compile policy).

    `buffers`: the runner's whole persistent step buffers (worker/input_buffers.py), with the
    room graphs/traced_step.py's `check_buffer_room` asks for. `cache`: where compiled graphs are
    kept (None: compiled in memory only). `attention_backend`: resolved (kernels/backends.py).
    `compiler`: how to start the background compiler (the "background" policy only).
    `before_inductor`: called before Inductor first compiles or loads a graph (the engine's
    graphs/inductor_warmup.py probes). A pipeline stage's model (distributed/pipeline_stages.py)
    gets its graph wrapped to run each step as micro-batches (graphs/pipeline_step_graph.py).
    """
    graph = _build_step_graph(
        model,
        kv_caches,
        buffers,
        config,
        cache=cache,
        attention_backend=attention_backend,
        tensor_parallel=tensor_parallel,
        compiler=compiler,
        before_inductor=before_inductor,
    )
    stage = pipeline_stage_of(model)
    if stage is None:
        return graph
    from compiled_engine.graphs.pipeline_step_graph import PipelineStepGraph, microbatch_count

    return PipelineStepGraph(  # type: ignore[return-value]
        graph, buffers, stage.index, stage.num_stages, microbatch_count(stage.num_stages)
    )


def _build_step_graph(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    buffers: StepInputs,
    config: EngineConfig,
    *,
    cache: CompileCache | None,
    attention_backend: AttentionBackend,
    tensor_parallel: TensorParallelLayout | None,
    compiler: CompilerProcess | None,
    before_inductor: Callable[[], None] | None,
) -> StepGraph:
    if config.enforce_eager:
        captured = capture_model(
            model,
            kv_caches,
            attention_backend=attention_backend,
            tensor_parallel=tensor_parallel,
            quantization=config.quantization,
        )
        return EagerStepGraph(captured, runtime_for(config.device), attention_backend)
    buckets = tuple(
        config.compile_buckets
        if config.compile_buckets
        else default_buckets(config.max_num_batched_tokens, config.max_num_seqs)
    )
    entry = None
    if cache is not None:
        entry = cache.entry(
            step_manifest(model, kv_caches, config, buckets, attention_backend, tensor_parallel)
        )
        if not entry.exists():
            logger.info("%s", entry.explain_miss())
    return CompiledStep(
        model,
        kv_caches,
        buffers,
        buckets,
        fuse_linears=config.fuse_linears,
        cache=entry,
        attention_backend=attention_backend,
        tensor_parallel=tensor_parallel,
        quantization=config.quantization,
        policy=config.compile_policy,
        # Recording a plan runs its step more than once: a pipeline stage's hand-offs and the
        # tensor-parallel collectives would go out more than once too. Those steps keep the wrapper.
        max_plan_tokens=(
            0
            if tensor_parallel is not None or pipeline_stage_of(model) is not None
            else config.max_cpu_plan_tokens
        ),
        compiler=compiler,
        before_inductor=before_inductor,
    )


def step_manifest(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    config: EngineConfig,
    buckets: tuple[int, ...],
    attention_backend: AttentionBackend,
    tensor_parallel: TensorParallelLayout | None,
) -> Manifest:
    """The compile-cache manifest of a compiled step: every input that shapes its graphs."""
    stage = pipeline_stage_of(model)
    options = GraphOptions(
        dtype=config.dtype,
        # int8 / fp8 codes when quantized (kernels/kv_quant.py); None: the model's dtype.
        kv_cache_dtype=None if kv_caches[0].dtype == config.dtype else kv_caches[0].dtype,
        block_size=config.block_size,
        buckets=buckets,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        # The block count is symbolic in the graphs (graphs/capture.py): not part of the key.
        kv_cache_shape=tuple(kv_caches[0].shape[:1] + kv_caches[0].shape[2:]),
        fuse_linears=config.fuse_linears,
        attention_backend=attention_backend.name,
        tensor_parallel=(f"{tensor_parallel.rank}/{tensor_parallel.world_size}" if tensor_parallel else "1"),
        quantization=config.quantization.label if config.quantization is not None else "none",
        pipeline_stage=stage.label if stage is not None else "1",
    )
    versions = step_component_versions(
        config.fuse_linears, attention_backend, tensor_parallel, config.quantization
    )
    if stage is not None:
        from compiled_engine.kernels.pipeline_transfer import PIPELINE_TRANSFER_VERSION

        versions = {**versions, "pipeline_transfer": PIPELINE_TRANSFER_VERSION}
    return build_manifest(model, options, config.device, versions)
