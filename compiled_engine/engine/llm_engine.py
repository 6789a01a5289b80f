"""Wires the stages together: input processing → engine core → output processing."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.core.engine_core import EngineCore
from compiled_engine.core.scheduler import Scheduler, SchedulerConfig
from compiled_engine.distributed.broadcasting_runner import BroadcastingRunner
from compiled_engine.distributed.pipeline_stages import (
    PipelineStage,
    join_stage_groups,
    leave_stage_groups,
    slice_for_stage,
    split_layers,
    stage_of_rank,
)
from compiled_engine.distributed.process_group import RendezvousAddress
from compiled_engine.distributed.runtime import TensorParallelRuntime
from compiled_engine.distributed.worker_main import serve_runner
from compiled_engine.engine.draft_model import build_draft_proposer
from compiled_engine.engine.input_processor import InputProcessor, ProcessedPrompt, ValidatedPrompt
from compiled_engine.engine.kv_cache_sizing import (
    KVCacheLayout,
    blocks_for_budget,
    cuda_free_memory_after,
    report_capacity,
)
from compiled_engine.engine.output_processor import OutputProcessor
from compiled_engine.engine.stats import EngineStats
from compiled_engine.engine_args import EngineArgs
from compiled_engine.errors import InvalidRequestError
from compiled_engine.graphs.inductor_warmup import InductorProbes
from compiled_engine.graphs.pipeline_step_graph import steps_in_flight
from compiled_engine.kernels.weight_quantization import check_model_quantizable
from compiled_engine.model_loader.loader import LoadedModel, _read_config, load_model
from compiled_engine.outputs import RequestOutput
from compiled_engine.records.request import Request
from compiled_engine.records.runner import Runner, RunnerTimeline
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.structured_output.compiler import GrammarCompilerPool
from compiled_engine.worker import kv_cache
from compiled_engine.worker.cpu_cores import split_cores
from compiled_engine.worker.model_runner import LaunchedStep, ModelRunner

logger = logging.getLogger(__name__)

RunnerFactory = Callable[[list[torch.Tensor]], ModelRunner]


class LLMEngine:
    def __init__(
        self, args: EngineArgs, *, _tensor_parallel_rank: tuple[int, RendezvousAddress] | None = None
    ) -> None:
        """Build every stage from `args` (`LLM(...)` makes them from its keyword arguments).
        `_tensor_parallel_rank` is for worker processes only (distributed/worker_main.py)."""
        if not isinstance(args, EngineArgs):
            raise TypeError(
                f"LLMEngine takes an EngineArgs, got {type(args).__name__}: "
                "LLMEngine(EngineArgs(model=..., ...)), or use LLM(...)"
            )
        if args.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 runs replicas behind `compiled-engine serve` "
                "(engine/data_parallel.py); one LLMEngine is one replica"
            )
        device = args.resolve_device()
        if device.type == "cpu" and args.cpu_reserved_cores and args.world_size == 1:
            # Steps use the cores left; the rest stay free for the API server and its clients,
            # which would otherwise preempt a step thread that every op then waits for.
            torch.set_num_threads(len(split_cores(args.cpu_reserved_cores).step))
        self.tensor_parallel: TensorParallelRuntime | None = None
        self.pipeline_stage: PipelineStage | None = None
        if args.world_size > 1:
            device = self._join_tensor_parallel(args, device, _tensor_parallel_rank)
        try:
            self._build(args, device)
        except BaseException:
            if self.tensor_parallel is not None:
                self.tensor_parallel.abort()
                leave_stage_groups()
            raise
        if self.tensor_parallel is not None:
            # Ends the workers when the engine is collected or the process exits.
            self._finalizer: weakref.finalize[[], None] = weakref.finalize(
                self, _close_runtime, self.tensor_parallel
            )

    def close(self) -> None:
        """Stop the background graph compiler and the tensor-parallel workers (if any), and leave
        their process group."""
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.step_graph.close()
        draft = getattr(self, "draft_proposer", None)
        if draft is not None:
            draft.close()
        grammars = getattr(self, "grammars", None)
        if grammars is not None:
            grammars.close()
        if self.tensor_parallel is not None:
            self._finalizer()

    # -- building, one step per method ---------------------------------------------------------------------

    def _join_tensor_parallel(
        self, args: EngineArgs, device: torch.device, rank_and_address: tuple[int, RendezvousAddress] | None
    ) -> torch.device:
        """Rank 0 starts the workers (each builds its rank from `args`, pickled, with
        serve_tensor_parallel_rank); every rank joins the group. On CUDA each rank takes the device
        of its own index. With pipeline stages (distributed/pipeline_stages.py) the group holds
        every stage's ranks, and each stage's tensor-parallel ranks get a group of their own."""
        num_layers = None
        if args.pipeline_parallel_size > 1:
            # Before any worker starts: more stages than layers is a clear error, not P failed ranks.
            num_layers = read_num_decoder_layers(args.resolve_model_dir())
            split_layers(num_layers, args.pipeline_parallel_size)
            steps_in_flight(args.pipeline_parallel_size)  # a bad override, too
        if device.type == "cuda":
            rank = 0 if rank_and_address is None else rank_and_address[0]
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        self.tensor_parallel = TensorParallelRuntime.start(
            args.world_size,
            device,
            partial(serve_tensor_parallel_rank, args),
            rank_and_address,
            launcher=args.distributed_executor_backend,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        if num_layers is not None:
            stage = stage_of_rank(
                self.tensor_parallel.rank, num_layers, args.pipeline_parallel_size, args.tensor_parallel_size
            )
            try:
                join_stage_groups(stage)
                # Rank 0 launches a step while later stages still run the one before: it must
                # not wait for them to take the message (distributed/process_group.py).
                self.tensor_parallel.group.use_posted_broadcasts()
            except BaseException:
                self.tensor_parallel.abort()
                raise
            self.pipeline_stage = stage
        return device

    def _build(self, args: EngineArgs, device: torch.device) -> None:
        """Load the model, resolve the options against it, size the KV cache, build the runner
        (warmed up, so an un-lowerable model fails at start-up), connect the stages."""
        # Inductor's CPU probes run while the model loads; the step waits for them only when
        # Inductor first runs (graphs/inductor_warmup.py).
        probes = InductorProbes(None) if args.enforce_eager else InductorProbes.start(device)
        loaded = self._load_model(args, device)
        self.config: EngineConfig = args.create_engine_config(device, loaded.model_config)
        if self.config.quantization is not None:
            # A layer the scheme cannot hold is refused now, before anything is traced or compiled.
            check_model_quantizable(loaded.model, self.config.quantization)
        layout = KVCacheLayout.of(loaded, self.config)

        def build_runner(caches: list[torch.Tensor]) -> ModelRunner:
            runner = ModelRunner(
                loaded.model,
                caches,
                self.config,
                tensor_parallel=loaded.tensor_parallel,
                before_inductor=probes.wait,
            )
            runner.warm_up()
            return runner

        num_kv_blocks, runner = self._size_kv_cache(loaded, layout, build_runner)
        runner = self._install_kv_cache(runner, layout.allocate(num_kv_blocks), build_runner)
        spec = self.config.speculative
        # Speculative decoding's draft model (engine/draft_model.py): its own runner and cache.
        self.draft_proposer = (
            build_draft_proposer(spec, loaded, self.config, num_kv_blocks)
            if spec is not None and spec.method == "draft_model"
            else None
        )
        self._connect_stages(loaded, runner, num_kv_blocks)

    def _load_model(self, args: EngineArgs, device: torch.device) -> LoadedModel:
        stage = self.pipeline_stage
        tp = self.tensor_parallel
        if stage is not None:
            tp_rank = (stage.tp_rank, stage.tp_size) if stage.tp_size > 1 else None
        else:
            tp_rank = (tp.rank, tp.world_size) if tp else None
        loaded = load_model(
            args.resolve_model_dir(),
            dtype=args.dtype,
            device=device,
            tensor_parallel=tp_rank,
            keep=stage.holds_tensor if stage is not None else None,  # a stage reads its own tensors only
        )
        # A pipeline stage keeps its own layers (and the embedding / the head where it has them).
        return slice_for_stage(loaded, stage) if stage is not None else loaded

    def _size_kv_cache(
        self, loaded: LoadedModel, layout: KVCacheLayout, build_runner: RunnerFactory
    ) -> tuple[int, ModelRunner | None]:
        """The KV block count: `num_kv_blocks`, else what `kv_cache_memory` bytes hold, else 1 GiB on
        CPU or what CUDA has left. Also the runner, when measuring CUDA's memory built it first."""
        config, tp = self.config, self.tensor_parallel
        runner = None
        if config.num_kv_blocks_override is not None:
            num_kv_blocks = config.num_kv_blocks_override
        else:
            if config.kv_cache_memory is not None:
                memory = config.kv_cache_memory
            elif config.device.type == "cuda":
                runner, memory = self._cuda_kv_cache_memory(loaded, layout, build_runner)
            else:
                memory = kv_cache.DEFAULT_CPU_KV_CACHE_BYTES
            num_kv_blocks = blocks_for_budget(
                memory, layout, config, agree_min=tp.group.agree_min if tp is not None else None
            )
        report_capacity(num_kv_blocks, config)
        return num_kv_blocks, runner

    def _cuda_kv_cache_memory(
        self, loaded: LoadedModel, layout: KVCacheLayout, build_runner: RunnerFactory
    ) -> tuple[ModelRunner | None, int]:
        """Build (compile, capture) on a one-block cache first, so the KV cache is sized from what
        is left once the graphs hold their memory; the real cache is swapped in afterwards."""
        config = self.config
        runner: ModelRunner | None = None
        graph_bytes = 0
        if config.enforce_eager:
            ids = torch.zeros(1, config.max_num_batched_tokens, dtype=torch.long, device=config.device)
            largest = partial(loaded.model, input_ids=ids, use_cache=False, logits_to_keep=1)
        else:
            runner = build_runner(layout.allocate(1))
            graph_bytes = runner.capture_graphs()
            runner.release_graphs()
            largest = partial(runner.run_dummy_step, config.max_num_batched_tokens)
        memory = cuda_free_memory_after(largest, config.device) - graph_bytes
        logger.info(
            "CUDA graphs take %.1f MiB; %.1f MiB left for the KV cache", graph_bytes / 2**20, memory / 2**20
        )
        return runner, memory

    def _install_kv_cache(
        self, runner: ModelRunner | None, caches: list[torch.Tensor], build_runner: RunnerFactory
    ) -> ModelRunner:
        """The runner on the real cache, with its decode graphs captured where the device has graphs
        (CUDA; CPU runs the bucket graphs directly: graphs/decode_graphs.py)."""
        if runner is None:
            runner = build_runner(caches)
        else:
            runner.set_kv_caches(caches)
        if runner.supports_graphs:
            runner.capture_graphs()
        runner.timeline = RunnerTimeline()  # start-up steps are not part of serving's timeline
        return runner

    def _connect_stages(self, loaded: LoadedModel, runner: ModelRunner, num_kv_blocks: int) -> None:
        """Input processing → scheduler and runner in the engine core → output processing."""
        config, tp = self.config, self.tensor_parallel
        self.model_config = loaded.model_config
        self.tokenizer = loaded.tokenizer
        # Pipeline parallelism: a step in flight per stage (the engine core's pipelined loop).
        depth = 1
        if self.pipeline_stage is not None:
            depth = steps_in_flight(self.pipeline_stage.num_stages)
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                block_size=config.block_size,
                num_kv_blocks=num_kv_blocks,
                max_in_flight_steps=2 if config.async_scheduling else depth,
                pipeline_depth=depth,
                enable_prefix_caching=config.enable_prefix_caching,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                step_token_buckets=config.compile_buckets,
                speculative=config.speculative,
                num_scheduler_steps=config.num_scheduler_steps,
            ),
            draft_proposer=self.draft_proposer,
        )
        # This rank's runner itself, for tools that read its graphs (`compiled-engine warmup`).
        self.model_runner = runner
        core_runner: Runner[LaunchedStep] = runner
        if tp is not None and tp.workers is not None:
            # Rank 0: each step (and what shapes it) reaches every rank before it runs here.
            core_runner = BroadcastingRunner(runner, tp.group, tp.workers)
        self.core = EngineCore(scheduler, core_runner, async_scheduling=config.async_scheduling)
        # Structured outputs: each distinct constraint compiled once, on a thread of its own.
        self.grammars = GrammarCompilerPool(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config, config.max_model_len, grammars=self.grammars
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._next_id = 0

    # -- state -----------------------------------------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        """Blocks the KV cache holds (sized at start-up; the scheduler's pool owns them)."""
        return self.core.scheduler.config.num_kv_blocks

    @property
    def num_preemptions(self) -> int:
        return self.core.scheduler.num_preemptions

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    def stats(self) -> EngineStats:
        scheduler, core, runner = self.core.scheduler, self.core.timeline, self.core.runner.timeline
        pool = scheduler.kv_cache_manager.block_pool
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_kv_blocks=self.num_kv_blocks,
            num_free_kv_blocks=self.num_free_kv_blocks(),
            num_preemptions=scheduler.num_preemptions,
            num_discarded_tokens=scheduler.num_discarded_tokens,
            async_scheduling=self.core.async_scheduling,
            num_steps=runner.num_steps,
            schedule_s=core.schedule_s,
            prepare_s=runner.prepare_s,
            execute_s=runner.execute_s,
            wait_s=runner.wait_s,
            update_s=core.update_s,
            step_wall_s=core.step_wall_s,
            prefix_caching=scheduler.config.enable_prefix_caching,
            prefix_cache_queries=scheduler.num_prefix_cache_queries,
            prefix_cache_hits=scheduler.num_prefix_cache_hits,
            num_cached_kv_blocks=pool.num_cached_blocks,
            num_evictable_kv_blocks=pool.num_evictable_blocks,
            graphs=self.model_runner.step_graph.status(),
            graph_waits=tuple(runner.graph_waits),
            num_fallback_steps=runner.num_fallback_steps,
            speculative=scheduler.config.speculative is not None,
            num_spec_steps=scheduler.num_spec_steps,
            num_draft_tokens=scheduler.num_draft_tokens,
            num_accepted_draft_tokens=scheduler.num_accepted_draft_tokens,
        )

    def pipeline_stage_times(self, reset: bool = False) -> list[Any]:
        """Pipeline parallelism: each rank's `StageTimes` (graphs/pipeline_step_graph.py: time in
        its stage's graph computing vs waiting for other stages), by rank; `reset` zeroes them."""
        runner = self.core.runner
        if self.pipeline_stage is None or not isinstance(runner, BroadcastingRunner):
            raise ValueError("pipeline_stage_times() needs an engine with pipeline_parallel_size > 1")
        return runner.stage_times(reset)

    def num_free_kv_blocks(self) -> int:
        return self.core.scheduler.kv_cache_manager.num_free_blocks

    def next_request_id(self) -> str:
        rid = str(self._next_id)
        self._next_id += 1
        return rid

    def validate(self, prompts, sampling_params) -> list[ValidatedPrompt]:
        """Validate every prompt before anything is queued (raises InvalidRequestError)."""
        return self.input_processor.validate_batch(prompts, sampling_params)

    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        """Queue a request. With n > 1 the core runs n children `f"{request_id}-{i}"` (sample i,
        seed + i when seeded); the output side gathers them into one RequestOutput."""
        child_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        for rid in dict.fromkeys([request_id, *child_ids]):
            if self.output_processor.has_request(rid):
                raise InvalidRequestError(f"request id {rid!r} is already in use")
        added: list[str] = []
        histories = {}
        try:
            for index, child_id in enumerate(child_ids):
                child_params = params if params.n == 1 else _child_sampling_params(params, index)
                request = Request(
                    request_id=child_id,
                    # The children share the prompt tuple; each has its own history.
                    prompt_token_ids=prompt.prompt_token_ids,
                    sampling_params=child_params,
                    eos_token_ids=self.model_config.eos_token_ids,
                    # Prompt logprobs need the logits of every prompt position, so such a
                    # request must not start from blocks the prefix cache holds: a salt of
                    # its own keeps it from matching any.
                    cache_salt=(
                        f"prompt_logprobs:{next(_private_salts)}"
                        if child_params.prompt_logprobs is not None
                        else None
                    ),
                    grammar=(
                        self.grammars.request_grammar(child_params.structured_outputs)
                        if child_params.structured_outputs is not None
                        else None
                    ),
                )
                self.core.add_request(request)
                histories[child_id] = request.history
                added.append(child_id)
        except BaseException:
            # The scheduler may still refuse (a prompt the whole cache cannot hold): undo the
            # children it took, so a refusal leaves no state behind.
            self.core.abort_requests(added)
            raise
        # Registered on the text side only once the core accepted every child.
        self.output_processor.add_request(request_id, prompt.prompt, params, histories)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (a request with n > 1: every one of its samples)."""
        core_ids = [child_id for rid in request_ids for child_id in self.output_processor.child_ids(rid)]
        self.core.abort_requests(core_ids)
        self.output_processor.abort(request_ids)

    def drain(self) -> None:
        """Finish every step in flight (their blocks return to the pool), dropping their outputs:
        for a caller that aborted everything it had queued."""
        self.core.drain()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        processed = self.output_processor.process(self.core.step())
        if processed.stopped_by_string:
            self.core.finish_requests(processed.stopped_by_string)
        return processed.request_outputs


def serve_tensor_parallel_rank(args: EngineArgs, rank: int, address: RendezvousAddress) -> None:
    """A tensor-parallel worker process's life (distributed/worker_main.py runs it): build rank
    `rank` with the very constructor rank 0 ran, so every start-up collective happens in the same
    order on every rank, then apply rank 0's runner calls to it until rank 0 says stop."""
    if args.resolve_device().type == "cpu":
        # The ranks share the host's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    engine = LLMEngine(args, _tensor_parallel_rank=(rank, address))
    tensor_parallel = engine.tensor_parallel
    assert tensor_parallel is not None  # args.world_size > 1
    try:
        serve_runner(engine.model_runner, tensor_parallel.group)
    finally:
        _close_runtime(tensor_parallel)


def _close_runtime(runtime: TensorParallelRuntime) -> None:
    """Leave the process group (rank 0: after ending the workers) and any stage group."""
    leave_stage_groups()
    runtime.close()


def read_num_decoder_layers(model_dir: str) -> int:
    """The decoder layers the folder's config names (for splitting them before any worker starts)."""
    config = _read_config(Path(model_dir))
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.num_hidden_layers)


# Unique per process: a cache salt no other request shares (see add_request).
_private_salts = itertools.count()


def _child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of a request with n > 1: its own seed (seed + index, vLLM's choice) so the
    samples differ yet reproduce; prompt logprobs computed once, by sample 0."""
    return dataclasses.replace(
        params,
        n=1,
        seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )
