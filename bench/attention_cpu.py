"""Per-layer cost of CPU paged decode attention: the reference op, the Inductor-compiled inline maths
(all shapes static, and as the engine's decode buckets compile it: block-table width symbolic), and
the cpu backend's C++ kernel (kernels/cpu_attention.py; an extern call, timed as graphs call it).

Decode steps at bench-small's attention shape (8 q heads, 4 kv heads, head dim 64, block 16, fp32),
every sequence at the same context length. Each row times one layer's attention —
this step's KV write plus the attention read — and sets it against the KV-read floor: the bytes
of K and V the step must read at least once, over the machine's measured streaming read rate.

    python -m bench.attention_cpu [--repeats 30] [--cases 64x512,1x512]

Not a pytest suite: it compiles three times (~10-20 s cold) and its numbers only mean something on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import compiled_engine.kernels  # noqa: F401  (registers torch.ops.compiled_engine.paged_attention)
from bench.floors import measure_memory_read
from compiled_engine.kernels.inline_attention import paged_attention_inline

NUM_Q_HEADS = 8
NUM_KV_HEADS = 4
HEAD_DIM = 64
BLOCK_SIZE = 16
DTYPE = torch.float32


@dataclass(frozen=True)
class DecodeStep:
    query: torch.Tensor  # [S, Hq, D]
    key: torch.Tensor  # [S, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, S * W + 1, block, Hkv, D]; the last block is scratch
    slot_mapping: torch.Tensor  # [S]
    block_tables: torch.Tensor  # [S, W] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32

    def op_args(self, scale: float) -> tuple:
        """The paged-attention op's positional arguments (inline_layer takes the same)."""
        return (
            self.query,
            self.key,
            self.value,
            self.kv_cache,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            scale,
        )

    @property
    def kv_bytes_read(self) -> int:
        # Every visible key and value once: the whole context of every sequence, K and V.
        num_seqs = self.query.shape[0]
        return 2 * num_seqs * int(self.seq_lens[0]) * NUM_KV_HEADS * HEAD_DIM * self.kv_cache.element_size()


def make_decode_step(num_seqs: int, context: int, seed: int = 0) -> DecodeStep:
    """`num_seqs` sequences whose `context`-th token is decoded now; blocks shuffled over the cache."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-context // BLOCK_SIZE)
    num_blocks = num_seqs * width
    kv_cache = torch.randn(2, num_blocks + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=DTYPE)
    # Shuffled ids, so neighbouring table entries are not neighbouring blocks, as after churn.
    tables = torch.randperm(num_blocks, generator=gen).view(num_seqs, width).to(torch.int32)
    last = context - 1
    slots = tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    return DecodeStep(
        query=torch.randn(num_seqs, NUM_Q_HEADS, HEAD_DIM, generator=gen, dtype=DTYPE),
        key=torch.randn(num_seqs, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=DTYPE),
        value=torch.randn(num_seqs, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=DTYPE),
        kv_cache=kv_cache,
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
    )


def reference_layer(step: DecodeStep, scale: float) -> torch.Tensor:
    # Through the registered op, as prefill buckets and the dynamic graph call it.
    return torch.ops.compiled_engine.paged_attention(*step.op_args(scale))


def inline_layer(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    torch.ops.compiled_engine.kv_cache_write(key, value, kv_cache, slot_mapping)
    return paged_attention_inline(query, kv_cache, block_tables, seq_lens, query_start_loc, scale)


def cpu_kernel_layer(step: DecodeStep, scale: float) -> torch.Tensor:
    # The KV write and the attention in one call, as every graph of the cpu backend calls it.
    return torch.ops.compiled_engine.paged_attention_cpu(*step.op_args(scale))


def inline_layer_symbolic_width(*args) -> torch.Tensor:
    # Its own function, so Dynamo compiles it apart from inline_layer (its cache is per code object).
    return inline_layer(*args)


def compile_symbolic_width(inputs: tuple) -> Callable[[], torch.Tensor]:
    """The inline layer compiled as the engine compiles a decode bucket: static token and sequence
    counts, the block-table width and the cache's block count symbolic (graphs/compiled_step.py)."""
    block_tables, kv_cache = inputs[5], inputs[3]
    torch._dynamo.mark_dynamic(block_tables, 1)
    torch._dynamo.mark_dynamic(kv_cache, 1)
    compiled = torch.compile(inline_layer_symbolic_width, fullgraph=True, backend="inductor")
    return lambda: compiled(*inputs)


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict:
    """name -> (median ms, min ms), calling the candidates in turn each round.

    Interleaved so that a burst of load from another process hits every candidate alike: on a
    shared 2-core machine the per-cell numbers swing by several times from run to run.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        seqs, context = item.lower().split("x")
        cases.append((int(seqs), int(context)))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.attention_cpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed rounds (median and min reported)")
    parser.add_argument("--cases", default="64x512,1x512", help="SEQSxCONTEXT,... decode cases")
    parser.add_argument(
        "--share",
        action="store_true",
        help="also time bench-small's engine decode step at each case and report attention's share",
    )
    args = parser.parse_args(argv)

    read_gb_s = measure_memory_read()
    scale = HEAD_DIM**-0.5
    print(
        f"decode attention, {NUM_Q_HEADS} q / {NUM_KV_HEADS} kv heads, head dim {HEAD_DIM}, "
        f"block {BLOCK_SIZE}, fp32, {torch.get_num_threads()} threads, "
        f"read {read_gb_s:.1f} GB/s; ms per layer, median / min of {args.repeats}"
    )
    columns = (
        "seqs x ctx",
        "reference eager",
        "inline static",
        "inline sym. width",
        "cpu kernel",
        "KV floor",
        "max |diff|",
    )
    print("{:>11} {:>17} {:>17} {:>17} {:>17} {:>9} {:>11}".format(*columns))
    for num_seqs, context in parse_cases(args.cases):
        step = make_decode_step(num_seqs, context)
        # Static shapes, as a shape-specialised decode bucket would be compiled.
        compiled = torch.compile(inline_layer, dynamic=False, fullgraph=True, backend="inductor")
        inputs = step.op_args(scale)
        expected = reference_layer(step, scale)
        symbolic = compile_symbolic_width(inputs)
        diff = max(
            (got - expected).abs().max().item()
            for got in (compiled(*inputs), symbolic(), cpu_kernel_layer(step, scale))
        )
        timings = time_interleaved(
            {
                "reference": lambda step=step: reference_layer(step, scale),
                "inline": lambda compiled=compiled, inputs=inputs: compiled(*inputs),
                "symbolic": symbolic,
                "cpu": lambda step=step: cpu_kernel_layer(step, scale),
            },
            args.repeats,
        )
        floor = step.kv_bytes_read / (read_gb_s * 1e9) * 1e3
        names = ("reference", "inline", "symbolic", "cpu")
        cells = [f"{timings[n][0]:.3f} / {timings[n][1]:.3f}" for n in names]
        case = f"{num_seqs} x {context}"
        print(f"{case:>11} " + " ".join(f"{c:>17}" for c in cells) + f" {floor:>9.3f} {diff:>11.1e}")
        if args.share:
            # The engine on the cpu backend, against that kernel's own per-layer time.
            step_ms = engine_decode_step_ms(num_seqs, context, args.repeats)
            layers = _bench_small_layers()
            attention_ms = layers * timings["cpu"][0]
            print(
                f"{'':>11} engine decode step {step_ms:.2f} ms (median, cpu backend); attention + KV "
                f"write {layers} x {timings['cpu'][0]:.3f} = {attention_ms:.2f} ms = "
                f"{attention_ms / step_ms:.0%} of the step; KV-read floor alone "
                f"{layers * floor / step_ms:.0%}"
            )
    return 0


def _bench_small_layers() -> int:
    from bench.models import BENCH_SMALL_CONFIG

    return BENCH_SMALL_CONFIG["num_hidden_layers"]


def engine_decode_step_ms(num_seqs: int, context: int, steps: int) -> float:
    """Median ms of bench-small engine steps (fp32, compiled) once `num_seqs` requests decode at
    about `context` tokens each: prompts of context - steps/2, then `steps` decode steps."""
    from bench.models import bench_small_dir
    from compiled_engine import LLM, SamplingParams

    prompt_len = max(1, context - steps // 2)
    llm = LLM(
        str(bench_small_dir()),
        dtype="float32",
        max_model_len=context + steps + 16,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=4096,
        num_kv_blocks=num_seqs * ((context + steps + 16) // BLOCK_SIZE + 1),
        async_scheduling=False,
        compile_policy="blocking",  # graphs built in the warm-up steps, not swapped in mid-timing
        attention_backend="cpu",
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [3 + (i * 31 + j) % 3000 for j in range(prompt_len)]} for i in range(num_seqs)
    ]
    for processed, checked in engine.validate(prompts, params):
        engine.add_request(engine.next_request_id(), processed, checked)
    produced: dict[str, int] = {}
    times = []
    while engine.has_unfinished_requests():
        decoding = len(produced) == num_seqs
        started = time.perf_counter()
        outputs = engine.step()
        if decoding:
            times.append((time.perf_counter() - started) * 1e3)
        for out in outputs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
    return statistics.median(times[2:])  # the first decode steps load or compile their bucket


if __name__ == "__main__":
    sys.exit(main())
