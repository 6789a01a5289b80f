"""Runs one scheduled step: inputs into persistent buffers → captured graph → sampler."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from compiled_engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from compiled_engine.graphs.buckets import default_buckets
from compiled_engine.graphs.capture import CapturedModel, capture_model
from compiled_engine.graphs.compile_cache import CacheEntry, CompileCache, use_inductor_cache_in
from compiled_engine.graphs.compile_manifest import GraphOptions, build_manifest
from compiled_engine.graphs.compiled_step import (
    MIN_BUFFER_BLOCKS,
    MIN_BUFFER_SEQS,
    CompiledStep,
    step_component_versions,
)
from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.worker.input_buffers import InputBuffers
from compiled_engine.worker.runner_output import ModelRunnerOutput
from compiled_engine.worker.sampler import Sampler, SamplingTensors

logger = logging.getLogger(__name__)


def seeded_generator(seed: int, num_output_tokens: int, device: torch.device) -> torch.Generator:
    """A generator that depends only on the request's seed and how far it has got.

    Deriving it per step (instead of keeping one per request) makes a seeded request's tokens
    independent of batching, preemption and step order, and leaves no per-request state to leak.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + num_output_tokens) % (1 << 63))
    return gen


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        seed: int = 0,
        enforce_eager: bool = False,
        compile_buckets: Sequence[int] | None = None,
        fuse_linears: bool = True,
        cache_dir: str | None = None,
    ) -> None:
        self.device = device
        self.kv_caches = kv_caches
        buffer_seqs, buffer_len = max_num_seqs, max_model_len
        if not enforce_eager:
            # Padding room the compiled graphs need (graphs/compiled_step.py); unused otherwise.
            buffer_seqs = max(buffer_seqs, MIN_BUFFER_SEQS)
            buffer_len = max(buffer_len, MIN_BUFFER_BLOCKS * block_size)
        self.buffers = InputBuffers(max_num_batched_tokens, buffer_seqs, buffer_len, block_size, device)
        # Eager: the lowered graphs run as they are, through Dynamo's frame (guards every step).
        # Compiled: Inductor graphs per token-count bucket, called directly (graphs/compiled_step.py),
        # with sibling linears fused when `fuse_linears` (the eager path never fuses: its graphs
        # are for debugging and stay one-to-one with the model's modules).
        self.captured: CapturedModel | None = None
        self.cache_entry: CacheEntry | None = None
        self.compiled_step: CompiledStep | None = None
        self.run_graph: Callable[[StepInputs], torch.Tensor]
        if enforce_eager:
            self.captured = self.run_graph = capture_model(model, kv_caches)
        else:
            buckets = (
                compile_buckets
                if compile_buckets is not None
                else default_buckets(max_num_batched_tokens, max_num_seqs)
            )
            buckets = tuple(buckets)
            cache = CompileCache(cache_dir)
            use_inductor_cache_in(cache.root)
            options = GraphOptions(
                dtype=kv_caches[0].dtype,
                block_size=block_size,
                buckets=buckets,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                # The block count is symbolic in the graphs (graphs/capture.py): not part of the key.
                kv_cache_shape=tuple(kv_caches[0].shape[:1] + kv_caches[0].shape[2:]),
                fuse_linears=fuse_linears,
                attention_backend="torch",
            )
            manifest = build_manifest(model, options, device, step_component_versions(fuse_linears))
            self.cache_entry = cache.entry(manifest)
            if not self.cache_entry.exists():
                logger.info("%s", self.cache_entry.explain_miss())
            self.compiled_step = CompiledStep(
                model,
                kv_caches,
                self.buffers.whole(),
                buckets,
                fuse_linears=fuse_linears,
                cache=self.cache_entry,
            )
            self.run_graph = self.compiled_step
        self.sampler = Sampler()
        # Unseeded requests share one engine-wide stream, seeded by LLM(seed=...).
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    @property
    def supports_graphs(self) -> bool:
        """Whether decode graphs are worth capturing: compiled mode on a device with graphs (CUDA)."""
        return self.compiled_step is not None and self.compiled_step.runtime.supports_graphs

    def capture_graphs(self) -> int:
        """Capture the decode graphs (compiled mode); returns the bytes they hold on the device."""
        if self.compiled_step is None:
            return 0
        return self.compiled_step.capture_graphs().memory_bytes

    def release_graphs(self) -> None:
        if self.compiled_step is not None:
            self.compiled_step.decode_graphs.release()

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Run on other KV-cache tensors of the same layout (compiled mode only)."""
        if self.compiled_step is None:
            raise RuntimeError("the eager path keeps the KV caches it was captured with")
        self.compiled_step.set_kv_caches(kv_caches)
        self.kv_caches = kv_caches

    def warm_up(self) -> None:
        """Capture and lower (compiled mode: and build one bucket) now, so an un-runnable model
        fails at start-up; the other buckets compile on first use.

        Two short sequences give Dynamo the general (dynamic) shapes first.
        """
        self.run_dummy_step(5, lengths=(3, 2))

    def run_dummy_step(self, num_tokens: int, lengths: Sequence[int] | None = None) -> None:
        """Run a step of `num_tokens` prompt tokens (sequences of `lengths`, default as few as fit).

        Every sequence maps all its positions into block 0: the k/v it writes land in a block
        every later owner overwrites before reading, and it needs only one block to exist.
        """
        if lengths is None:
            longest = self.buffers.max_blocks_per_seq * self.buffers.block_size
            lengths = [min(longest, num_tokens - start) for start in range(0, num_tokens, longest)]
            lengths = lengths[: self.buffers.seq_lens.shape[0]]
        greedy = SamplingParams(temperature=0.0)
        block = self.buffers.block_size
        dummy = tuple(
            ScheduledRequest(
                request_id=f"dummy-{i}",
                token_ids=(0,) * n,
                start_position=0,
                block_ids=(0,) * -(-n // block),
                sample=True,
                sampling_params=greedy,
                num_output_tokens=0,
            )
            for i, n in enumerate(lengths)
        )
        self.execute(SchedulerOutput(dummy, sum(lengths), (), ()))

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        prepared = self.buffers.prepare(step)
        logits = self.run_graph(prepared.inputs)
        if not prepared.sampled_rows:
            return ModelRunnerOutput(request_ids=(), sampled_token_ids=())
        sampled = [step.scheduled[i] for i in prepared.sampled_rows]
        generators = [
            seeded_generator(r.sampling_params.seed, r.num_output_tokens, self.device)
            if r.sampling_params.seed is not None
            else None
            for r in sampled
        ]
        tensors = SamplingTensors.build(
            [r.sampling_params for r in sampled], generators, self.device, default_generator=self.generator
        )
        token_ids = self.sampler(logits, tensors).tolist()
        return ModelRunnerOutput(
            request_ids=tuple(r.request_id for r in sampled), sampled_token_ids=tuple(token_ids)
        )
