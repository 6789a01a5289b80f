"""Host work per engine step, with the device's work taken out: a null model.

The engine is the real one — `LLMEngine` with its `EngineCore`, `Scheduler` (prefix caching on,
as users get it), `ModelRunner` staging and loading every step buffer, the output processor and
the embedded model's tokenizer detokenizing every token — but the step graph is `NullStepGraph`
(returns a fixed logits tensor, no forward) and the sampler is `NullSampler` (returns tokens of
real text from a fixed table, no sampling maths). What a step then costs is the host's work:
schedule + stage + load + sampling bookkeeping + update + outputs.

    python -m bench.null_model [--running 1 64 256] [--steps 200] [--output-kind KIND ...]
                               [--profile cprofile.out] [--phases] [--stream-mb MB]

`--output-kind` sets the requests' `SamplingParams.output_kind`: `final_only` is what
`LLM.generate` asks of the engine, `delta` what the server's engine asks, `cumulative` the
engine's default for a direct `LLMEngine` user (every step a snapshot of every request's tokens).

`--phases` also reports the median wall time of each stage of a step: the scheduler's `schedule`
and `update`, the runner's `launch` (staging, loading, the null graph and sampler) and `collect`,
and the output processor's `process`.

`--stream-mb MB` makes the null step graph read MB megabytes (a float32 tensor summed on the
step's threads) where the forward would run, as a real model's decode step reads its weights:
on the CPU that read evicts the host's code and data from the caches, so the host work after it
runs as it does beside a real model (docs/performance.md measures how much slower). The read's
own time is left out of the step times reported.

`bench/test_host_overhead.py` times the same steps under pytest-benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from compiled_engine.default_model_path import default_model_dir
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_args import EngineArgs
from compiled_engine.graphs.device import runtime_for
from compiled_engine.graphs.step_inputs import StepInputs
from compiled_engine.records.graph_status import EAGER, GraphCall, GraphStatus
from compiled_engine.sampling_params import RequestOutputKind, SamplingParams
from compiled_engine.worker import model_runner

PROMPT_LEN = 32
BLOCK_SIZE = 16
# Long enough that no request ends during warm-up and timing at the default step counts.
MAX_MODEL_LEN = 1024
MAX_TOKENS = MAX_MODEL_LEN - PROMPT_LEN
# Steps to get every request past its prefill before timing starts.
WARMUP_STEPS = 8


class NullStepGraph:
    """A `StepGraph` (graphs/step_graph.py) that runs no model: each call returns the front of one
    preallocated logits tensor, one row per logits index, so no device time is spent."""

    cache_entry = None
    supports_graphs = False
    attention_backend = None
    last_call: GraphCall | None = GraphCall(EAGER, EAGER)

    def __init__(
        self, buffers: StepInputs, vocab_size: int, device: torch.device, stream_bytes: int = 0
    ) -> None:
        self.runtime = runtime_for(device)
        self.builds: dict = {}
        self._logits = torch.zeros(buffers.logits_indices.shape[0], vocab_size, device=device)
        # What a forward would read (--stream-mb), and the seconds and calls spent reading it.
        # (Seconds of wall time, and of this thread's CPU time: the sum runs on every thread.)
        self._stream = torch.ones(stream_bytes // 4, device=device) if stream_bytes > 0 else None
        self.stream_s = self.stream_cpu_s = 0.0
        self.num_streams = 0

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        if self._stream is not None:
            started, started_cpu = time.perf_counter(), time.thread_time()
            self._stream.sum()
            self.stream_s += time.perf_counter() - started
            self.stream_cpu_s += time.thread_time() - started_cpu
            self.num_streams += 1
        return self._logits[: inputs.logits_indices.shape[0]]

    def status(self) -> GraphStatus:
        return GraphStatus()

    def close(self) -> None:
        pass

    def capture_graphs(self) -> int:
        return 0

    def release_graphs(self) -> None:
        pass

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        pass

    def all_buckets(self) -> list[int | None]:
        return []

    def compile_buckets(self, buckets=None, show_progress=False) -> None:
        pass


class NullSampler:
    """The runner's sampler, minus the maths: row i of the n-th call gets token
    `text[(97 * i + n) % len(text)]`, real tokens so the detokenizer does its real work."""

    def __init__(self, text_token_ids: Sequence[int], max_rows: int, device: torch.device) -> None:
        ids = torch.tensor(text_token_ids, dtype=torch.int64)
        steps = torch.arange(len(ids))[:, None]
        rows = torch.arange(max_rows)[None, :]
        self._table = ids[(97 * rows + steps) % len(ids)].to(device)  # [len(text), max_rows]
        self._calls = 0

    def __call__(self, logits: torch.Tensor, params) -> torch.Tensor:
        tokens = self._table[self._calls % self._table.shape[0], : logits.shape[0]]
        self._calls += 1
        return tokens


@contextlib.contextmanager
def _null_step_graphs(vocab_size: int, stream_bytes: int = 0) -> Iterator[None]:
    """Runners built inside get a `NullStepGraph` instead of a traced model."""
    real = model_runner.build_step_graph

    def build(model, kv_caches, buffers, config, **_ignored):
        return NullStepGraph(buffers, vocab_size, config.device, stream_bytes)

    model_runner.build_step_graph = build  # type: ignore[assignment]
    try:
        yield
    finally:
        model_runner.build_step_graph = real  # type: ignore[assignment]


def null_engine(max_num_seqs: int, stream_bytes: int = 0, **options) -> LLMEngine:
    """The engine on the embedded model (its tokenizer, its vocabulary), with the null step graph
    (reading `stream_bytes` a step: `--stream-mb`) and sampler, sized for `max_num_seqs` requests
    decoding to MAX_MODEL_LEN."""
    model_dir = default_model_dir()
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    args = EngineArgs(
        model=str(model_dir),
        device="cpu",
        enforce_eager=True,  # no compile cache, no background compiler: nothing is traced anyway
        async_scheduling=False,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=max(2048, max_num_seqs * PROMPT_LEN),
        block_size=BLOCK_SIZE,
        num_kv_blocks=max_num_seqs * (MAX_MODEL_LEN // BLOCK_SIZE),
        **options,
    )
    with _null_step_graphs(vocab_size, stream_bytes):
        engine = LLMEngine(args)
    runner = engine.model_runner
    text = _text_token_ids(engine.tokenizer)
    runner.sampler = NullSampler(text, runner.buffers.max_num_seqs, runner.device)
    return engine


def _text_token_ids(tokenizer) -> list[int]:
    """Real source text as tokens (no special tokens), for the null sampler's table."""
    text = Path(__file__).read_text()
    special = set(tokenizer.all_special_ids)
    return [t for t in tokenizer.encode(text, add_special_tokens=False) if t not in special]


def start_decoding(
    engine: LLMEngine,
    num_running: int,
    seed: int = 0,
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
) -> list[str]:
    """Queue `num_running` requests of distinct PROMPT_LEN-token prompts that never stop early,
    and step until every one of them is decoding (one token a step); returns their ids."""
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=output_kind)
    prompts = torch.randint(3, vocab, (num_running, PROMPT_LEN), generator=generator).tolist()
    request_ids = [engine.next_request_id() for _ in prompts]
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        engine.add_request(request_id, _token_prompt(engine, prompt), params)
    for _ in range(WARMUP_STEPS):
        engine.step()
    scheduler = engine.core.scheduler
    if scheduler.num_running != num_running or scheduler.num_waiting:
        raise RuntimeError(
            f"expected {num_running} running requests after warm-up, got {scheduler.num_running} "
            f"running and {scheduler.num_waiting} waiting"
        )
    return request_ids


def _token_prompt(engine: LLMEngine, token_ids: list[int]):
    (validated,) = engine.validate([{"prompt_token_ids": token_ids}], SamplingParams(max_tokens=MAX_TOKENS))
    return validated.processed


def stop_all(engine: LLMEngine, request_ids: list[str]) -> None:
    """Abort the requests `start_decoding` queued, so the engine starts the next workload empty."""
    engine.abort_request(request_ids)
    engine.drain()
    if engine.has_unfinished_requests():
        raise RuntimeError("requests are left in the engine after aborting every one it was given")


def time_steps(engine: LLMEngine, num_steps: int) -> tuple[list[float], list[float]]:
    """Wall seconds, and this thread's CPU seconds, of each of `num_steps` engine steps (on a
    shared machine the CPU time leaves out the time other processes held the core), without the
    null graph's `--stream-mb` read."""
    graph = engine.model_runner.step_graph
    wall, cpu = [], []
    for _ in range(num_steps):
        streamed, streamed_cpu = graph.stream_s, graph.stream_cpu_s
        started, started_cpu = time.perf_counter(), time.thread_time()
        engine.step()
        ended, ended_cpu = time.perf_counter(), time.thread_time()
        wall.append(ended - started - (graph.stream_s - streamed))
        cpu.append(ended_cpu - started_cpu - (graph.stream_cpu_s - streamed_cpu))
    return wall, cpu


# The stages of a step `--phases` times: (what owns it, its method).
PHASES = (
    ("scheduler", "schedule"),
    ("runner", "launch"),
    ("runner", "collect"),
    ("scheduler", "update"),
    ("output_processor", "process"),
)


@contextlib.contextmanager
def timed_phases(engine: LLMEngine) -> Iterator[dict[str, list[float]]]:
    """Wall seconds of every call of each stage in PHASES while inside (the engine's own methods,
    wrapped on the instances and restored after)."""
    owners = {
        "scheduler": engine.core.scheduler,
        "runner": engine.model_runner,
        "output_processor": engine.output_processor,
    }
    seconds: dict[str, list[float]] = {name: [] for _, name in PHASES}
    graph = engine.model_runner.step_graph

    def timed(real, calls: list[float]):
        def call(*args, **kwargs):
            streamed = graph.stream_s  # the launch's --stream-mb read is left out, as time_steps does
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                calls.append(time.perf_counter() - started - (graph.stream_s - streamed))

        return call

    for owner, name in PHASES:
        setattr(owners[owner], name, timed(getattr(owners[owner], name), seconds[name]))
    try:
        yield seconds
    finally:
        for owner, name in PHASES:
            delattr(owners[owner], name)  # the instance attribute goes: the class's method again


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--output-kind",
        nargs="+",
        choices=[kind.value for kind in RequestOutputKind],
        default=[kind.value for kind in RequestOutputKind],
    )
    parser.add_argument("--profile", help="write a cProfile of the timed steps to this file")
    parser.add_argument("--phases", action="store_true", help="also report each stage's median wall time")
    parser.add_argument(
        "--stream-mb",
        type=float,
        default=0.0,
        help="megabytes the null step graph reads a step, as a model's weights (left out of the times)",
    )
    args = parser.parse_args(argv)
    if args.steps > MAX_TOKENS - WARMUP_STEPS:
        parser.error(f"--steps must be at most {MAX_TOKENS - WARMUP_STEPS}: the requests end after that")
    if args.stream_mb < 0:
        parser.error(f"--stream-mb must be 0 or more, got {args.stream_mb}")
    engine = null_engine(max(args.running), stream_bytes=int(args.stream_mb * 1024 * 1024))
    for num_running in args.running:
        for kind in args.output_kind:
            request_ids = start_decoding(engine, num_running, output_kind=RequestOutputKind(kind))
            if args.profile:
                import cProfile

                profiler = cProfile.Profile()
                profiler.enable()
            with timed_phases(engine) if args.phases else contextlib.nullcontext() as phases:
                wall, cpu = time_steps(engine, args.steps)
            if args.profile:
                profiler.disable()
                profiler.dump_stats(f"{args.profile}.{num_running}.{kind}")
            print(
                f"{num_running:4d} running, {kind:>10}: wall median {statistics.median(wall) * 1e3:.3f} "
                f"ms/step (min {min(wall) * 1e3:.3f}), thread CPU median "
                f"{statistics.median(cpu) * 1e3:.3f} ms/step (min {min(cpu) * 1e3:.3f}), {len(wall)} steps"
            )
            if phases is not None:
                print(
                    "      stages, median ms: "
                    + ", ".join(
                        f"{name} {statistics.median(calls) * 1e3:.3f}"
                        for name, calls in phases.items()
                        if calls
                    )
                )
            stop_all(engine, request_ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
