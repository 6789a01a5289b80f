"""Wires the stages together: input processing → engine core → output processing."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from compiled_engine.config import EngineConfig
from compiled_engine.core.engine_core import EngineCore
from compiled_engine.core.scheduler import Scheduler, SchedulerConfig
from compiled_engine.distributed.broadcasting_runner import BroadcastingRunner
from compiled_engine.distributed.process_group import RendezvousAddress
from compiled_engine.distributed.runtime import TensorParallelRuntime
from compiled_engine.distributed.worker_main import serve_runner
from compiled_engine.engine.input_processor import InputProcessor, ProcessedPrompt
from compiled_engine.engine.output_processor import OutputProcessor
from compiled_engine.engine.stats import EngineStats
from compiled_engine.errors import InvalidRequestError
from compiled_engine.graphs.inductor_warmup import finish_cpu_probes, start_cpu_probes
from compiled_engine.model_loader.loader import LoadedModel, load_model
from compiled_engine.outputs import RequestOutput
from compiled_engine.records.request import Request
from compiled_engine.records.runner import Runner, RunnerTimeline
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.worker import kv_cache
from compiled_engine.worker.model_runner import LaunchedStep, ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

# `async_scheduling=None` picks per device. CUDA: the host prepares step N+1 while the GPU runs
# step N. CPU: off — the model and the host share the same two cores and the GIL, and the bench
# (docs/performance.md, "Async loop") measured the worker-thread loop slower than the synchronous one.
ASYNC_SCHEDULING_DEFAULT = {"cuda": True, "cpu": False}


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _cuda_free_memory_after(run_largest_step: Callable[[], None], device: torch.device) -> int:
    """Bytes left for the KV cache after the largest step has run once, on CUDA."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        run_largest_step()
    torch.cuda.synchronize(device)
    _, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    return max(0, int(total * kv_cache.CUDA_KV_CACHE_FRACTION) - peak)


class LLMEngine:
    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        seed: int = 0,
        device: str | torch.device | None = None,
        enforce_eager: bool = False,
        compile_buckets: Sequence[int] | None = None,
        fuse_linears: bool = True,
        cache_dir: str | None = None,
        async_scheduling: bool | None = None,
        attention_backend: str = "auto",
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        _tensor_parallel_rank: tuple[int, RendezvousAddress] | None = None,
    ) -> None:
        """`_tensor_parallel_rank` is for worker processes only (distributed/worker_main.py)."""
        # Everything but the model and the device: what _build needs, and (with the device and size) what a
        # tensor-parallel worker needs to build its own rank of this engine.
        options = {
            "dtype": dtype,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "block_size": block_size,
            "num_kv_blocks": num_kv_blocks,
            "kv_cache_memory": kv_cache_memory,
            "seed": seed,
            "enforce_eager": enforce_eager,
            "compile_buckets": None if compile_buckets is None else tuple(compile_buckets),
            "fuse_linears": fuse_linears,
            "cache_dir": cache_dir,
            "async_scheduling": async_scheduling,
            "attention_backend": attention_backend,
            "enable_prefix_caching": enable_prefix_caching,
        }
        worker_kwargs = {
            "model": model,
            **options,
            "device": None if device is None else str(device),
            "tensor_parallel_size": tensor_parallel_size,
        }
        dev = (
            torch.device(device)
            if device is not None
            else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        _positive_int("max_num_seqs", max_num_seqs)
        _positive_int("block_size", block_size)
        _positive_int("tensor_parallel_size", tensor_parallel_size)
        self.tensor_parallel: TensorParallelRuntime | None = None
        if tensor_parallel_size > 1:
            if async_scheduling:
                raise ValueError(
                    "async_scheduling=True is not supported with tensor_parallel_size > 1: every rank "
                    "runs each step as rank 0 scheduled it (the synchronous loop)"
                )
            options["async_scheduling"] = False
            if dev.type == "cuda":
                rank = 0 if _tensor_parallel_rank is None else _tensor_parallel_rank[0]
                dev = torch.device("cuda", rank)
                torch.cuda.set_device(dev)
            self.tensor_parallel = TensorParallelRuntime.start(
                tensor_parallel_size,
                dev,
                partial(serve_tensor_parallel_rank, worker_kwargs),
                _tensor_parallel_rank,
            )
        try:
            self._build(model, dev, **options)
        except BaseException:
            if self.tensor_parallel is not None:
                self.tensor_parallel.abort()
            raise
        if self.tensor_parallel is not None:
            # Ends the workers when the engine is collected or the process exits.
            self._finalizer = weakref.finalize(self, self.tensor_parallel.close)

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any) and leave their process group."""
        if self.tensor_parallel is not None:
            self._finalizer()

    def _build(
        self,
        model: str,
        dev: torch.device,
        *,
        dtype: str,
        max_model_len: int | None,
        max_num_seqs: int,
        max_num_batched_tokens: int | None,
        block_size: int,
        num_kv_blocks: int | None,
        kv_cache_memory: int | None,
        seed: int,
        enforce_eager: bool,
        compile_buckets: Sequence[int] | None,
        fuse_linears: bool,
        cache_dir: str | None,
        async_scheduling: bool | None,
        attention_backend: str,
        enable_prefix_caching: bool,
    ) -> None:
        tp = self.tensor_parallel
        if async_scheduling is None:
            async_scheduling = ASYNC_SCHEDULING_DEFAULT.get(dev.type, False)
        elif not isinstance(async_scheduling, bool):
            raise ValueError(f"async_scheduling must be None, True or False, got {async_scheduling!r}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        # Inductor's CPU probes run while the model loads (graphs/inductor_warmup.py).
        cpu_probes = None if enforce_eager else start_cpu_probes(dev)
        loaded: LoadedModel = load_model(
            model, dtype=dtype, device=dev, tensor_parallel=(tp.rank, tp.world_size) if tp else None
        )
        mc = loaded.model_config
        # This rank's share of the KV heads (all of them without tensor parallelism).
        kv_heads = loaded.tensor_parallel.local_kv_heads if loaded.tensor_parallel else mc.num_kv_heads
        limit = mc.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        _positive_int("max_model_len", max_model_len)
        if max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)

        block_bytes = kv_cache.bytes_per_block(mc.num_layers, block_size, kv_heads, mc.head_dim, mc.dtype)

        def allocate(num_blocks: int) -> list[torch.Tensor]:
            return kv_cache.allocate_kv_caches(
                mc.num_layers, num_blocks, block_size, kv_heads, mc.head_dim, mc.dtype, dev
            )

        def build_runner(caches: list[torch.Tensor]) -> ModelRunner:
            finish_cpu_probes(cpu_probes)
            runner = ModelRunner(
                loaded.model,
                caches,
                block_size=block_size,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                device=dev,
                seed=seed,
                enforce_eager=enforce_eager,
                compile_buckets=compile_buckets,
                fuse_linears=fuse_linears,
                cache_dir=cache_dir,
                async_scheduling=async_scheduling,
                attention_backend=attention_backend,
                tensor_parallel=loaded.tensor_parallel,
            )
            runner.warm_up()
            return runner

        runner: ModelRunner | None = None
        if num_kv_blocks is not None:
            _positive_int("num_kv_blocks", num_kv_blocks)
        else:
            if kv_cache_memory is not None:
                _positive_int("kv_cache_memory", kv_cache_memory)
                memory = kv_cache_memory
            elif dev.type == "cuda":
                # Build (compile, capture) on a one-block cache first, so the KV cache is sized
                # from what is left once the graphs hold their memory; then swap the real cache in.
                graph_bytes = 0
                if enforce_eager:
                    ids = torch.zeros(1, max_num_batched_tokens, dtype=torch.long, device=dev)
                    largest = partial(loaded.model, input_ids=ids, use_cache=False, logits_to_keep=1)
                else:
                    runner = build_runner(allocate(1))
                    graph_bytes = runner.capture_graphs()
                    runner.release_graphs()
                    largest = partial(runner.run_dummy_step, max_num_batched_tokens)
                memory = _cuda_free_memory_after(largest, dev) - graph_bytes
                logger.info(
                    "CUDA graphs take %.1f MiB; %.1f MiB left for the KV cache",
                    graph_bytes / 2**20,
                    memory / 2**20,
                )
            else:
                memory = kv_cache.DEFAULT_CPU_KV_CACHE_BYTES
            num_kv_blocks = min(
                kv_cache.blocks_for_memory(memory, block_bytes),
                kv_cache.useful_block_limit(max_num_seqs, max_model_len, block_size),
            )
            if tp is not None:
                # Every rank must hold the same blocks: the smallest count that fits on all.
                num_kv_blocks = tp.group.agree_min(num_kv_blocks)
            if num_kv_blocks < 1:
                raise ValueError(
                    f"{memory} bytes of KV cache memory do not hold one block ({block_bytes} bytes)"
                )
        if num_kv_blocks * block_size < max_model_len:
            logger.warning(
                "KV cache holds %d tokens, less than max_model_len=%d: longer requests are rejected",
                num_kv_blocks * block_size,
                max_model_len,
            )
        kv_cache.log_cache_capacity(num_kv_blocks, block_size, max_model_len)

        self.config = EngineConfig(
            model_dir=str(model),
            dtype=mc.dtype,
            device=dev,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            seed=seed,
        )
        self.model_config = mc
        self.tokenizer = loaded.tokenizer
        caches = allocate(num_kv_blocks)
        if runner is None:
            runner = build_runner(caches)
        else:
            runner.set_kv_caches(caches)
        # Decode graphs per bucket where the device has graphs (CUDA); CPU runs the bucket
        # graphs directly (graphs/decode_graphs.py).
        if runner.supports_graphs:
            runner.capture_graphs()
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                max_in_flight_steps=2 if async_scheduling else 1,
                enable_prefix_caching=enable_prefix_caching,
            )
        )
        runner.timeline = RunnerTimeline()  # start-up steps are not part of serving's timeline
        # This rank's runner itself, for tools that read its graphs (`compiled-engine warmup`).
        self.model_runner = runner
        core_runner: Runner[LaunchedStep] = runner
        if tp is not None and tp.workers is not None:
            # Rank 0: each step (and what shapes it) reaches every rank before it runs here.
            core_runner = BroadcastingRunner(runner, tp.group, tp.workers)
        self.core = EngineCore(scheduler, core_runner, async_scheduling=async_scheduling)
        self.input_processor = InputProcessor(self.tokenizer, mc, max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._next_id = 0

    @property
    def num_kv_blocks(self) -> int:
        return self.config.num_kv_blocks

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
            num_kv_blocks=self.config.num_kv_blocks,
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
        )

    def num_free_kv_blocks(self) -> int:
        return self.core.scheduler.kv_cache_manager.num_free_blocks

    def next_request_id(self) -> str:
        rid = str(self._next_id)
        self._next_id += 1
        return rid

    def validate(self, prompts, sampling_params) -> list[tuple[ProcessedPrompt, SamplingParams]]:
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


def serve_tensor_parallel_rank(engine_kwargs: dict[str, Any], rank: int, address: RendezvousAddress) -> None:
    """A tensor-parallel worker process's life (distributed/worker_main.py runs it): build rank
    `rank` with the very constructor rank 0 ran, so every start-up collective happens in the same
    order on every rank, then apply rank 0's runner calls to it until rank 0 says stop."""
    device = engine_kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cpu":
        # The ranks share the host's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // engine_kwargs["tensor_parallel_size"]))
    engine = LLMEngine(**engine_kwargs, _tensor_parallel_rank=(rank, address))
    tensor_parallel = engine.tensor_parallel
    assert tensor_parallel is not None  # tensor_parallel_size > 1 in engine_kwargs
    try:
        serve_runner(engine.core.runner, tensor_parallel.group)
    finally:
        tensor_parallel.group.close()


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
