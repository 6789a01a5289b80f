"""Runs one scheduled step: inputs into persistent buffers → captured graph → sampler → logprobs."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from compiled_engine.config import EngineConfig
from compiled_engine.distributed.layout import TensorParallelLayout
from compiled_engine.graphs.background_builds import CompilerProcess
from compiled_engine.graphs.compile_cache import CompileCache, usable_compile_cache, use_inductor_cache_in
from compiled_engine.graphs.cpu_step_plan import RunDraws
from compiled_engine.graphs.device import Event
from compiled_engine.graphs.pipeline_step_graph import PipelineStepGraph
from compiled_engine.graphs.step_graph import StepGraph, build_step_graph
from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.graphs.traced_step import MIN_BUFFER_BLOCKS, MIN_BUFFER_SEQS
from compiled_engine.kernels import cpu_sampler
from compiled_engine.kernels.backends import resolve_attention_backend
from compiled_engine.records.request import TokenHistory
from compiled_engine.records.runner import RunnerTimeline
from compiled_engine.records.runner_output import ModelRunnerOutput, PromptLogprobs, TokenLogprobs
from compiled_engine.records.scheduler_output import ScheduledRequest, SchedulerOutput
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.structured_output.logits_mask import GrammarMasks
from compiled_engine.worker.cpu_cores import split_cores
from compiled_engine.worker.execution_stream import stream_for
from compiled_engine.worker.input_buffers import InputBuffers
from compiled_engine.worker.persistent_batch import PersistentBatch
from compiled_engine.worker.sampler import Sampler, SamplingTensors, draws_in_cpp, token_logprobs
from compiled_engine.worker.spec_verifier import accepted_prefix, verify_proposals
from compiled_engine.worker.staging import RequestState, StagedStep, StagingSlot
from compiled_engine.worker.step_buffers import LogprobResults

logger = logging.getLogger(__name__)


def seeded_generator(seed: int, num_output_tokens: int, device: torch.device) -> torch.Generator:
    """A generator that depends only on the request's seed and how far it has got.

    Deriving it per step (instead of keeping one per request) makes a seeded request's tokens
    independent of batching, preemption and step order, and leaves no per-request state to leak.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + num_output_tokens) % (1 << 63))
    return gen


# Speculative decoding: a seeded row's proposal rows draw from a stream of their own, so their
# acceptance draws never repeat the noise its sampling row draws from `seeded_generator`.
_PROPOSAL_STREAM = 0x5DEECE66DA5A5A5


def proposal_generator(seed: int, num_output_tokens: int, device: torch.device) -> torch.Generator:
    """The generator a seeded request's proposal rows use, as `seeded_generator` a function of
    the seed and the tokens generated so far only."""
    gen = torch.Generator(device=device)
    gen.manual_seed(((seed * 1_000_003 + num_output_tokens) ^ _PROPOSAL_STREAM) % (1 << 63))
    return gen


class _Samples:
    """A step's sampled tokens on the device, filled in when its work runs (maybe on the worker):
    the next step's placeholders read them there."""

    tokens: torch.Tensor | None = None
    # A multi-step run's tokens, [num_steps, rows] (the first step's are `tokens`).
    run_tokens: torch.Tensor | None = None


@dataclass(eq=False)
class LaunchedStep:
    """A step whose work is queued on the execution stream; `collect` turns it into results."""

    step: SchedulerOutput
    sampled_request_ids: tuple[str, ...]
    slot: StagingSlot
    staged: StagedStep
    done: Event
    samples: _Samples
    # Pipeline parallelism: the step's sampling (and everything else that reads its logits), run
    # by `collect` once the last stage's logits arrived; None when `launch` did it already.
    finish: Callable[[], None] | None = None

    @property
    def block_ids(self) -> frozenset[int]:
        """Every KV block the step reads or writes (for the checks that nothing reuses them
        early; built when asked, not on the step path)."""
        return frozenset(b for r in self.step.scheduled for b in r.block_ids)

    @functools.cached_property
    def sample_index(self) -> dict[str, int]:
        """Request id -> its row in this step's sampled tokens (read by the next step's
        placeholders, so only built when a step has some)."""
        return {request_id: row for row, request_id in enumerate(self.sampled_request_ids)}


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        config: EngineConfig,
        *,
        tensor_parallel: TensorParallelLayout | None = None,
        before_inductor: Callable[[], None] | None = None,
    ) -> None:
        """Runs `model` on `kv_caches` as `config` says (its block count is the caches' own).
        `before_inductor`: called before Inductor first compiles or loads a graph here."""
        self.device = device = config.device
        cache = None if config.enforce_eager else usable_compile_cache(config.cache_dir)
        if cache is not None:
            # Before the backend: the CPU kernel builds into Inductor's cache dir, kept in ours.
            use_inductor_cache_in(cache.root)
        # Resolved first: an unavailable backend is a clear error before anything is built.
        self.attention_backend = resolve_attention_backend(config.attention_backend, device)
        self.kv_caches = kv_caches
        # Padding room the compiled graphs need (graphs/traced_step.py); unused by the eager path.
        buffer_seqs = max(config.max_num_seqs, MIN_BUFFER_SEQS)
        buffer_len = max(config.max_model_len, MIN_BUFFER_BLOCKS * config.block_size)
        self.buffers = InputBuffers(
            config.max_num_batched_tokens, buffer_seqs, buffer_len, config.block_size, device
        )
        # Compiled Inductor graphs per token-count bucket, or (enforce_eager) the lowered graphs
        # through Dynamo's frame: one protocol either way (graphs/step_graph.py).
        self.step_graph: StepGraph = build_step_graph(
            model,
            kv_caches,
            self.buffers.whole(),
            config,
            cache=cache,
            attention_backend=self.attention_backend,
            tensor_parallel=tensor_parallel,
            compiler=self._compiler_process(config, cache, kv_caches),
            before_inductor=before_inductor,
        )
        self.sampler = Sampler()
        # Unseeded requests share one engine-wide stream, seeded by LLM(seed=...).
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.seed)
        # Steps run on an execution stream (worker/execution_stream.py): inline for the
        # synchronous loop, a CPU worker or a CUDA stream for the async one. Two staging slots
        # let the host fill step N+1's while step N still reads its own.
        self.stream = stream_for(self.step_graph.runtime, config.async_scheduling)
        weakref.finalize(self, self.stream.close)  # the CPU worker thread ends with the runner
        # Requests whose sampling needs their history (penalties, min_tokens, prompt logprobs):
        # registered by the engine core, passed to a slot each time it stages a step.
        self.request_states: dict[str, RequestState] = {}
        # One row per running request, updated in place step to step (worker/persistent_batch.py).
        self.batch = PersistentBatch(self.buffers.max_num_seqs, self.buffers.max_blocks_per_seq)
        # A pipeline stage's step graph returns before the last stage's logits arrive: the runner
        # then samples in `collect`, and keeps each step in flight in a staging slot of its own
        # until then (one step per stage in flight: core/engine_core.py), as sampling reads it.
        self._stage_graph = self.step_graph if isinstance(self.step_graph, PipelineStepGraph) else None
        num_slots = 2 if self._stage_graph is None else max(2, self._stage_graph.num_stages)
        self._slots = [self.buffers.new_slot(self.stream.new_event()) for _ in range(num_slots)]
        self._num_launches = 0
        self._previous: LaunchedStep | None = None
        self._in_flight: deque[LaunchedStep] = deque()
        self.timeline = RunnerTimeline()

    @staticmethod
    def _compiler_process(
        config: EngineConfig, cache: CompileCache | None, kv_caches: list[torch.Tensor]
    ) -> CompilerProcess | None:
        """How to start the background compiler (worker/graph_compiler_process.py), for the
        "background" policy; it rebuilds this runner's step graph in its own process."""
        if config.enforce_eager or config.compile_policy != "background" or cache is None:
            return None
        from compiled_engine.worker.graph_compiler_process import COMPILER_NICENESS, CompileJob

        job = CompileJob(
            config=dataclasses.replace(config, cache_dir=str(cache.root)),
            kv_cache_shapes=tuple(tuple(c.shape) for c in kv_caches),
        )
        # Off the step threads' cores where some are reserved (worker/cpu_cores.py).
        cores = split_cores(config.cpu_reserved_cores).other if config.device.type == "cpu" else ()
        return CompilerProcess(
            "compiled_engine.worker.graph_compiler_process", job, niceness=COMPILER_NICENESS, cores=cores
        )

    def add_request(
        self,
        request_id: str,
        history: TokenHistory,
        params: SamplingParams,
        eos_token_ids: Collection[int] = (),
    ) -> bool:
        """Keep what the request's sampling needs beyond a step's tokens, if anything: penalties
        count its prompt and outputs, min_tokens bans its EOS ids, prompt logprobs read its prompt.
        `history` is the scheduler's record, read at staging and never copied here (under tensor
        parallelism a worker receives a replica of it: see record_outputs)."""
        if params.has_penalties or params.min_tokens > 0 or params.prompt_logprobs is not None:
            self.request_states[request_id] = RequestState(history, frozenset(eos_token_ids))
            return True
        return False

    def record_outputs(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Output tokens the scheduler accepted for a request (after a step's update).

        The scheduler's own history already holds them; only a replica — a tensor-parallel
        worker's copy of it, which lives in another process — takes them here."""
        state = self.request_states.get(request_id)
        if state is not None and state.history.is_replica:
            state.history.extend_replica(token_ids)

    def remove_requests(self, request_ids: Collection[str]) -> None:
        """Forget requests that ended; steps already staged keep what they copied."""
        for request_id in request_ids:
            self.request_states.pop(request_id, None)
        self.batch.remove(request_ids)

    @property
    def supports_graphs(self) -> bool:
        """Whether decode graphs are worth capturing: compiled mode on a device with graphs (CUDA)."""
        return self.step_graph.supports_graphs

    def capture_graphs(self) -> int:
        """Capture the decode graphs (compiled mode); returns the bytes they hold on the device."""
        return self.step_graph.capture_graphs()

    def release_graphs(self) -> None:
        self.step_graph.release_graphs()

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Run on other KV-cache tensors of the same layout (compiled mode only)."""
        self.step_graph.set_kv_caches(kv_caches)
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
            lengths = lengths[: self.buffers.max_num_seqs]
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
        try:
            self.execute(SchedulerOutput(dummy, sum(lengths), (), ()))
        finally:
            self.batch.remove(r.request_id for r in dummy)

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to completion (the synchronous loop and start-up)."""
        return self.collect(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> LaunchedStep:
        """Stage the step and queue its work; returns at once when the stream is asynchronous.

        Placeholder tokens in the step are the previous launch's samples, read on the device.
        """
        slot = self._slots[self._num_launches % len(self._slots)]
        consumed = slot.consumed
        assert consumed is not None  # __init__ gives each of the runner's slots an event
        consumed.synchronize()  # the step that used this slot has copied it out
        started = time.perf_counter()
        previous = self._previous
        try:
            staged = slot.fill(
                step,
                _SampleIndex(previous) if previous is not None else None,
                self.request_states,
                self.batch,
            )
        except BaseException:
            self.batch.clear()  # maybe half updated: rebuilt from the next steps' block lists
            raise
        scheduled = step.scheduled
        sampled_request_ids = staged.sampled_request_ids
        generators: tuple[torch.Generator | None, ...] = (None,) * len(sampled_request_ids)
        if staged.special_sampled:  # only those rows can be seeded
            generators = tuple(
                self._generator_for(scheduled[row]) if i in staged.special_sampled else None
                for i, row in enumerate(staged.sampled_rows)
            )
        grammar_masks = None
        if staged.grammar_bitmasks is not None:
            grammar_masks = GrammarMasks.of_rows(staged.grammar_bitmasks)
        proposal_generators = self._proposal_generators(scheduled, staged)
        proposal_masks = _proposal_grammar_masks(scheduled, staged) if staged.num_proposal_rows else None
        draft_probs = None
        if staged.num_proposal_rows and not staged.proposals_all_greedy:
            draft_probs = _draft_probs(scheduled, staged, self.device)
        samples = _Samples()
        previous_samples = previous.samples if previous is not None else None
        step_number = self.timeline.num_steps
        self.timeline.prepare_s += time.perf_counter() - started

        def sample(logits: torch.Tensor, inputs: StepInputs) -> SamplingTensors | None:
            """Sampling rows first, then prompt-logprobs rows; raw model logits (never modified).
            Returns the sampling rows' settings (None: no row samples)."""
            tensors = None
            k = len(generators)
            if k:
                tensors = self.buffers.sampling_tensors(staged, generators, self.generator)
                # Structured outputs: tokens the grammar forbids are -inf for everything after.
                sample_logits = logits[:k] if grammar_masks is None else grammar_masks.apply(logits[:k])
                samples.tokens = self.sampler(sample_logits, tensors)
                slot.buffers.sampled_tokens[:k].copy_(samples.tokens, non_blocking=True)
                if staged.num_top_logprobs is not None:
                    results = token_logprobs(sample_logits, samples.tokens, staged.num_top_logprobs)
                    _copy_logprobs(slot.buffers.sample_logprobs, results)
                if staged.num_proposal_rows:
                    self._verify_proposals(
                        logits,
                        inputs,
                        staged,
                        slot,
                        tensors,
                        proposal_generators,
                        proposal_masks,
                        draft_probs,
                    )
            if staged.prompt_logprobs:
                e = staged.num_prompt_logprob_rows
                targets = self.buffers.prompt_logprob_targets(e)
                results = token_logprobs(logits[k : k + e], targets, staged.num_top_prompt_logprobs)
                _copy_logprobs(slot.buffers.prompt_logprobs, results)
            return tensors

        finish: list[Callable[[], None]] = []

        def work() -> None:
            began = time.perf_counter()
            inputs = self.buffers.load(
                slot, staged, previous_samples.tokens if previous_samples is not None else None
            )
            if self._stage_graph is not None:
                if staged.num_steps > 1:
                    raise RuntimeError("a pipeline stage runs one step a schedule (num_scheduler_steps=1)")
                pending = self._stage_graph.start(inputs)
                self.timeline.record_graph_call(step_number, self.step_graph.last_call)

                def sample_when_logits_arrive() -> None:
                    began = time.perf_counter()
                    logits = pending.wait()
                    arrived = time.perf_counter()
                    self.timeline.wait_s += arrived - began
                    # Later steps staged their own inputs since: this step's go back first (the
                    # sampling buffers, proposal rows and logprob targets are read from there).
                    sample(logits, self.buffers.load(slot, staged))
                    self.timeline.execute_s += time.perf_counter() - arrived

                finish.append(sample_when_logits_arrive)
            else:
                logits = self.step_graph(inputs)
                self.timeline.record_graph_call(step_number, self.step_graph.last_call)
                tensors = sample(logits, inputs)
                if staged.num_steps > 1:
                    assert samples.tokens is not None and tensors is not None  # every row of a run samples
                    samples.run_tokens = self._run_on(
                        inputs, scheduled, samples.tokens, staged.num_steps, tensors
                    )
            self.timeline.execute_s += time.perf_counter() - began

        self.stream.submit(work)
        self.stream.record(consumed)
        done = self.stream.new_event()
        self.stream.record(done)
        self._num_launches += 1
        self.timeline.num_steps += 1
        launched = LaunchedStep(
            step=step,
            sampled_request_ids=sampled_request_ids,
            slot=slot,
            staged=staged,
            done=done,
            samples=samples,
            finish=finish[0] if finish else None,
        )
        self._previous = launched
        self._in_flight.append(launched)
        return launched

    def _run_on(
        self,
        inputs: StepInputs,
        scheduled: tuple[ScheduledRequest, ...],
        tokens: torch.Tensor,
        num_steps: int,
        params: SamplingTensors,
    ) -> torch.Tensor:
        """Multi-step scheduling (ScheduledRequest.num_steps): the step's rows decode
        `num_steps - 1` more tokens, each step fed the tokens the one before picked. The scheduler
        runs only rows (`scheduled`, every one sampling) whose logits nothing but the sampler
        reads, and gave each the blocks of the whole run, so the host stages nothing: the tokens,
        positions, lengths and slots move on in the step's own buffers (numpy views: CPU only, as
        EngineArgs allows) and the same graph (its replayed plan) runs again. Where every row
        picks greedily or draws with a temperature alone, and the step replayed a plan, the run
        goes on in C++ (`CpuStepPlan.decode_on`, the sampler's C++ kernels); rows with top-k,
        top-p or min-p run in Python, each step through the step graph and the sampler. Either
        way a run's rows draw the uniform numbers single steps would, in the same order
        (`_run_uniforms`, or the sampler itself), so a run samples the tokens single steps
        sample. Returns every step's tokens, [num_steps, rows]."""
        if inputs.input_ids.device.type != "cpu":
            raise RuntimeError("multi-step runs are CPU-only (num_scheduler_steps)")
        if params.changes_logits:
            raise RuntimeError("a multi-step run's logits are the model's (no penalties, bias or min_tokens)")
        block_size = self.buffers.block_size
        num_rows = tokens.shape[0]
        plan = self.step_graph.decode_plan(num_rows)
        if plan is not None and draws_in_cpp(plan.output, params):
            # The step replayed a recorded plan: the whole run goes on in C++ from there.
            run = torch.empty(num_steps, num_rows, dtype=torch.int64)
            run[0] = tokens
            draw = None
            if not params.all_greedy:
                draw = RunDraws(
                    cpu_sampler.temperature_draw_kernel_address(),
                    params.greedy.contiguous(),
                    params.temperature.contiguous(),
                    self._run_uniforms(scheduled, num_steps, params),
                )
            plan.decode_on(cpu_sampler.greedy_kernel_address(), run, inputs, block_size, draw)
            return run
        ids, positions, seq_lens = (
            inputs.input_ids.numpy()[0],
            inputs.positions.numpy(),
            inputs.seq_lens.numpy(),
        )
        slots, table = inputs.slot_mapping.numpy(), inputs.block_tables.numpy()
        rows = np.arange(num_rows)
        runs = [tokens]
        seeded = any(generator is not None for generator in params.generators)
        step_params = params
        for step in range(1, num_steps):
            if seeded:  # a seeded row's generator is a function of its output count (`seeded_generator`)
                generators = tuple(self._generator_for(row, step) for row in scheduled)
                step_params = dataclasses.replace(params, generators=generators)
            ids[:] = runs[-1].numpy()
            positions += 1
            seq_lens += 1
            position = positions[0]
            slots[:] = table[rows, position // block_size] * block_size + position % block_size
            logits = self.step_graph(inputs)
            runs.append(self.sampler(logits[:num_rows], step_params))
        return torch.stack(runs)

    def _run_uniforms(
        self, scheduled: tuple[ScheduledRequest, ...], num_steps: int, params: SamplingTensors
    ) -> torch.Tensor:
        """The uniform numbers the steps after a run's first would draw one by one, float32
        [num_steps - 1, rows]: the sampler's `uniform_noise` of each step, a [rows] draw from the
        engine's generator (a CPU generator fills a tensor in order: one [steps, rows] draw is the
        same stream), then a seeded row's number from its own generator of that step."""
        uniform = torch.rand(num_steps - 1, len(scheduled), generator=params.default_generator)
        for i, row in enumerate(scheduled):
            for step in range(1, num_steps):
                generator = self._generator_for(row, step)
                if generator is not None:
                    uniform[step - 1, i] = torch.rand((), generator=generator)
        return uniform

    def _proposal_generators(
        self, scheduled: tuple[ScheduledRequest, ...], staged: StagedStep
    ) -> tuple[torch.Generator | None, ...]:
        """Per proposal row: its request's proposal generator when it is seeded and samples, else
        None (the engine-wide stream). Empty when no row samples with proposals."""
        if staged.proposals_all_greedy:
            return ()
        generators: list[torch.Generator | None] = []
        for row, count in zip(staged.spec_rows, staged.num_proposed, strict=True):
            request = scheduled[staged.sampled_rows[row]]
            params = request.sampling_params
            gen = None
            if not params.greedy and params.seed is not None:
                gen = proposal_generator(params.seed, request.num_output_tokens, self.device)
            generators += [gen] * count  # one generator per request: its rows draw in turn
        return tuple(generators)

    def _verify_proposals(
        self,
        logits: torch.Tensor,
        inputs: StepInputs,
        staged: StagedStep,
        slot: StagingSlot,
        tensors: SamplingTensors,
        generators: tuple[torch.Generator | None, ...],
        grammar_masks: GrammarMasks | None,
        draft_probs: torch.Tensor | None,
    ) -> None:
        """Speculative decoding: decide which proposals the target keeps (worker/spec_verifier.py)
        and queue the results' copy to the slot; `collect` turns them into tokens. `draft_probs`:
        per proposal row the distribution it was drawn from (`_draft_probs`), None: point masses."""
        first = staged.num_sampled + staged.num_prompt_logprob_rows
        d = staged.num_proposal_rows
        proposal_logits = logits[first : first + d]
        if grammar_masks is not None:
            # Structured outputs: each proposal row under its own position's grammar mask.
            proposal_logits = grammar_masks.apply(proposal_logits)
        # Row i's proposal is the token fed right after it (the step's input, already on the device).
        proposed = inputs.input_ids[0].index_select(0, inputs.logits_indices[first : first + d] + 1)
        params = None
        if not staged.proposals_all_greedy:
            rows = torch.tensor(staged.proposal_sample_rows, dtype=torch.int64, device=logits.device)
            params = tensors.select_rows(rows, generators)
        accepted, recovered = verify_proposals(proposal_logits, proposed, params, draft_probs)
        slot.buffers.proposal_accepted[:d].copy_(accepted, non_blocking=True)
        slot.buffers.proposal_recovered[:d].copy_(recovered, non_blocking=True)
        if staged.num_top_logprobs is not None:
            # Each row's emitted token: its proposal while kept, the drawn one at the first rejection.
            emitted = torch.where(accepted, proposed, recovered)
            results = token_logprobs(proposal_logits, emitted, staged.num_top_logprobs)
            _copy_logprobs(slot.buffers.proposal_logprobs, results)

    def _generator_for(self, request: ScheduledRequest, ahead: int = 0) -> torch.Generator | None:
        """A seeded sampling row's own generator (`ahead` tokens on: a multi-step run's later
        steps); None for greedy rows and for the shared stream."""
        params = request.sampling_params
        if params.greedy or params.seed is None:
            return None
        return seeded_generator(params.seed, request.num_output_tokens + ahead, self.device)

    def collect(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step (the oldest not yet collected) and return its tokens."""
        if not self._in_flight or self._in_flight[0] is not launched:
            raise ValueError("collect() takes the oldest launched step that was not collected yet")
        if launched.finish is not None:
            with torch.inference_mode():  # as `launch`: it writes the buffers that mode made
                launched.finish()  # on the inline stream: pipeline stages run the synchronous loop
            done = self.stream.new_event()
            self.stream.record(done)
            done.synchronize()  # on CUDA: the sampled tokens' copy to the host
        else:
            started = time.perf_counter()
            launched.done.synchronize()
            self.timeline.wait_s += time.perf_counter() - started
        self._in_flight.popleft()
        num_sampled = len(launched.sampled_request_ids)
        tokens = launched.slot.buffers.sampled_tokens[:num_sampled].tolist() if num_sampled else []
        logprobs = _sample_logprobs(launched.slot, launched.staged, tokens)
        num_accepted = draft_logprobs = None
        if launched.staged.num_proposal_rows:
            num_accepted, draft_logprobs = _apply_verification(
                launched.slot, launched.staged, launched.sampled_request_ids, tokens, logprobs
            )
        runs = None
        if launched.samples.run_tokens is not None:  # a multi-step run: per row, its tokens in order
            runs = tuple(map(tuple, launched.samples.run_tokens.t().tolist()))
        return ModelRunnerOutput(
            request_ids=launched.sampled_request_ids,
            sampled_token_ids=tuple(tokens),
            logprobs=logprobs,
            prompt_logprobs=_prompt_logprobs(launched.slot, launched.staged),
            num_accepted_drafts=num_accepted,
            draft_logprobs=draft_logprobs,
            step_token_ids=runs,
        )

    def blocks_in_flight(self) -> frozenset[int]:
        """KV blocks read or written by steps launched and not yet collected."""
        return frozenset().union(*(launched.block_ids for launched in self._in_flight))

    def reset_after_failure(self) -> None:
        """Forget every launched step after one failed, so the engine can run new steps."""
        self.stream.reset()
        self._in_flight.clear()
        self._previous = None
        self.batch.clear()

    def close(self) -> None:
        self.stream.close()
        self.step_graph.close()


def _draft_probs(
    scheduled: tuple[ScheduledRequest, ...], staged: StagedStep, device: torch.device
) -> torch.Tensor | None:
    """Per proposal row, the distribution q its proposal was drawn from [D, vocab]: the draft's
    (`ScheduledRequest.draft_probs`), or one-hot for a deterministic proposal; None when every
    proposal is deterministic (the verifier's point-mass rule, which one-hot rows equal)."""
    requests = [scheduled[staged.sampled_rows[row]] for row in staged.spec_rows]
    drawn = [request.draft_probs for request in requests if request.draft_probs is not None]
    if not drawn:
        return None
    # The draft's vocabulary is the target's (engine/draft_model.py checks it at load).
    q = np.zeros((staged.num_proposal_rows, drawn[0].shape[-1]), dtype=np.float32)
    first = 0
    for request, count in zip(requests, staged.num_proposed, strict=True):
        if request.draft_probs is not None:
            q[first : first + count] = request.draft_probs[:count]
        else:
            q[np.arange(first, first + count), request.token_ids[len(request.token_ids) - count :]] = 1.0
        first += count
    return torch.from_numpy(q).to(device)


def _proposal_grammar_masks(
    scheduled: tuple[ScheduledRequest, ...], staged: StagedStep
) -> GrammarMasks | None:
    """Per proposal row, its position's grammar mask (structured outputs); None when no
    request with proposals is constrained."""
    masks: list[np.ndarray | None] = []
    for row, count in zip(staged.spec_rows, staged.num_proposed, strict=True):
        request_masks = scheduled[staged.sampled_rows[row]].proposal_bitmasks
        masks += list(request_masks) if request_masks is not None else [None] * count
    return GrammarMasks.of_rows(masks)


def _copy_logprobs(
    into: LogprobResults, results: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """Queue the device-to-host copy of `token_logprobs` results into a slot's result buffers."""
    top_ids, top_values, chosen, ranks = results
    rows, num_top = top_ids.shape
    into.top_ids.view(rows, num_top).copy_(top_ids, non_blocking=True)
    into.top_values.view(rows, num_top).copy_(top_values, non_blocking=True)
    into.chosen.front(rows).copy_(chosen, non_blocking=True)
    into.ranks.front(rows).copy_(ranks, non_blocking=True)


def _read_logprobs(
    results: LogprobResults, rows: int, num_top: int, token_ids: Sequence[int], keep: Sequence[int]
) -> list[TokenLogprobs]:
    """Turn a collected step's result buffers into records, keeping `keep[i]` top entries for row i."""
    top_ids = results.top_ids.view(rows, num_top).tolist()
    top_values = results.top_values.view(rows, num_top).tolist()
    chosen = results.chosen.front(rows).tolist()
    ranks = results.ranks.front(rows).tolist()
    return [
        TokenLogprobs(token_ids[i], chosen[i], ranks[i], tuple(top_ids[i][:n]), tuple(top_values[i][:n]))
        for i, n in enumerate(keep)
    ]


def _sample_logprobs(
    slot: StagingSlot, staged: StagedStep, tokens: list[int]
) -> tuple[TokenLogprobs | None, ...] | None:
    num_top = staged.num_top_logprobs
    if num_top is None:
        return None
    keep = [n or 0 for n in staged.logprobs]
    records = _read_logprobs(slot.buffers.sample_logprobs, len(tokens), num_top, tokens, keep)
    return tuple(
        record if n is not None else None for record, n in zip(records, staged.logprobs, strict=True)
    )


def _apply_verification(
    slot: StagingSlot,
    staged: StagedStep,
    request_ids: tuple[str, ...],
    tokens: list[int],
    logprobs: tuple[TokenLogprobs | None, ...] | None,
) -> tuple[tuple[int, ...], dict[str, tuple[TokenLogprobs, ...]] | None]:
    """Read a step's verification: per sampling row the proposals kept; a row whose proposal was
    rejected emits the token drawn there instead of its sampling row's (`tokens` is updated in
    place). With logprobs: per row with proposals, a record for every token it emits."""
    d = staged.num_proposal_rows
    accepted = slot.buffers.proposal_accepted[:d].tolist()
    recovered = slot.buffers.proposal_recovered[:d].tolist()
    records = None
    if staged.num_top_logprobs is not None:
        emitted = [
            t if kept else r
            for t, kept, r in zip(staged.proposed_token_ids, accepted, recovered, strict=True)
        ]
        keep = [staged.logprobs[row] or 0 for row in staged.proposal_sample_rows]
        records = _read_logprobs(slot.buffers.proposal_logprobs, d, staged.num_top_logprobs, emitted, keep)
    num_accepted = [0] * len(tokens)
    run_logprobs: dict[str, tuple[TokenLogprobs, ...]] = {}
    start = 0
    for row, count in zip(staged.spec_rows, staged.num_proposed, strict=True):
        kept = accepted_prefix(accepted, start, count)
        num_accepted[row] = kept
        last = logprobs[row] if logprobs is not None else None
        if kept < count:
            tokens[row] = recovered[start + kept]
            last = records[start + kept] if records is not None else None
        if records is not None and last is not None and staged.logprobs[row] is not None:
            run_logprobs[request_ids[row]] = (*records[start : start + kept], last)
        start += count
    return tuple(num_accepted), run_logprobs or None


def _prompt_logprobs(slot: StagingSlot, staged: StagedStep) -> dict[str, PromptLogprobs] | None:
    if not staged.prompt_logprobs:
        return None
    rows = staged.num_prompt_logprob_rows
    targets = slot.buffers.prompt_logprob_targets.front(rows).tolist()
    keep = [chunk.num_top for chunk in staged.prompt_logprobs for _ in range(chunk.num_rows)]
    records = _read_logprobs(
        slot.buffers.prompt_logprobs, rows, staged.num_top_prompt_logprobs, targets, keep
    )
    chunks, start = {}, 0
    for chunk in staged.prompt_logprobs:
        entries = tuple(records[start : start + chunk.num_rows])
        chunks[chunk.request_id] = PromptLogprobs(chunk.first_position, entries)
        start += chunk.num_rows
    return chunks


class _SampleIndex(Mapping[str, int]):
    """The previous step's `sample_index`, built only if staging reads it (placeholders)."""

    def __init__(self, launched: LaunchedStep) -> None:
        self._launched = launched

    def __getitem__(self, request_id: str) -> int:
        return self._launched.sample_index[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._launched.sample_index)

    def __len__(self) -> int:
        return len(self._launched.sampled_request_ids)
