"""One prepared device check: environment, greedy parity with transformers, decode timings.

Written for a short GPU session (one command, a few minutes), and runnable on CPU so it is
tested in CI:

    python -m bench.gpu_check --device cuda --out gpu_report.md   # GPU session (default 420 s budget)
    python -m bench.gpu_check --device cpu --quick                # CPU smoke run (tests/test_gpu_check.py)

Sections run in priority order, each guarded: an error is written into the report and the run goes
on; once `--budget-s` is spent the remaining sections are listed as skipped. The report (markdown) is
written line by line to stdout and to `--out`, so a run killed by an outer timeout still leaves
everything it had measured.

Exit status: 1 if any parity case had an unexcused divergence or failed to run; 2 if only other
sections failed; 0 otherwise (sections skipped for the budget do not fail the run).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

import torch

if TYPE_CHECKING:
    from compiled_engine.graphs.device import DeviceRuntime

NUM_PROMPTS = 16
QUICK_NUM_PROMPTS = 4
MAX_PROMPT_LEN = 100
MAX_NEW_TOKENS = 12
PROMPT_SEED = 7
# A divergence is excused only where the reference's top-2 logits are this close: a near-tie that
# rounding can flip. bf16 logits are themselves rounded to 8 significant bits, so two logits near 3
# are either equal or 2**-6 = 0.0156 apart: a fixed 1e-2 would fail one-ulp ties. bf16 therefore
# excuses up to TIE_ULPS_BF16 units in the last place of the top logit, and never less than 1e-2.
TIE_TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2}
TIE_ULPS_BF16 = 2
COMPILE_BUCKETS = (1, 2, 4, 8, 16)
QUICK_COMPILE_BUCKETS = (16,)
# Engine limits shared by every case: prompts <= 100 tokens + 12 new fit in 128 positions, and the
# KV cache is sized explicitly (on CUDA the engine would otherwise claim 90% of the device).
MAX_MODEL_LEN = 128
BLOCK_SIZE = 16
PARITY_MAX_NUM_SEQS = 16
EAGER_MAX_NUM_BATCHED_TOKENS = 256

TIMING_PROMPT_LEN = 16
TIMING_CONCURRENCY = (1, 16, 64)
TIMING_BUCKETS = (1, 16, 64)
TIMING_WARMUP_STEPS = 2
TIMING_MEASURED_STEPS = 8
QUICK_TIMING_WARMUP_STEPS = 2  # on CPU the first one or two decode steps of a batch run 10-100x slower
QUICK_TIMING_MEASURED_STEPS = 3

# Bucket graphs: a standalone toy step captured per bucket through graphs/device.py.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
QUICK_GRAPH_BUCKETS = (1, 4)
GRAPH_TIMED_CALLS = 50
QUICK_GRAPH_TIMED_CALLS = 5
# Relative to the largest |logit|: a replay runs the kernels the plain call ran, so only a
# different cuBLAS algorithm inside the capture could move a logit, by fp32 rounding.
GRAPH_TOLERANCE = 1e-5

DEFAULT_BUDGET_S = 420.0
PARITY_SECTION = "parity"


# -- report and budget -------------------------------------------------------------------------


class Report:
    """Markdown lines to stdout and (line-buffered) to a file, plus the run's failure tallies."""

    def __init__(self, out: Path | None) -> None:
        self._file: TextIO | None = out.open("w", buffering=1, encoding="utf-8") if out else None
        self.parity_failures: list[str] = []
        self.section_errors: list[str] = []
        self.skipped: list[str] = []

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        if self._file is not None:
            self._file.write(text + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def exceeded(self) -> bool:
        return self.elapsed() > self.seconds


class Section(NamedTuple):
    title: str
    kind: str  # PARITY_SECTION or another label: decides which exit status an error maps to
    run: Callable[[Report], None]


def run_sections(sections: list[Section], report: Report, budget: Budget) -> None:
    for section in sections:
        if budget.exceeded():
            report.line(f"\n### {section.title}\n- skipped: time budget of {budget.seconds:.0f} s spent")
            report.skipped.append(section.title)
            continue
        report.line(f"\n### {section.title}")
        started = time.perf_counter()
        try:
            section.run(report)
        except Exception as exc:  # one failure must not lose the rest of a short device session
            for err_line in error_lines(exc):
                report.line(err_line)
            target = report.parity_failures if section.kind == PARITY_SECTION else report.section_errors
            target.append(f"{section.title}: {type(exc).__name__}")
        finally:
            _release_memory()
        report.line(
            f"- section time {time.perf_counter() - started:.1f} s (run total {budget.elapsed():.0f} s)"
        )


ERROR_MESSAGE_LINES = 4
ERROR_FRAMES = 16


def error_lines(exc: BaseException) -> list[str]:
    """The error's first message lines and the Python frames of its innermost cause.

    Torch's messages can carry pages of C++ frames: those are cut, the Python frames kept.
    """
    message = str(exc).strip().splitlines() or [""]
    lines = [f"- ERROR: {type(exc).__name__}: {message[0]}", "```"]
    lines += message[1:ERROR_MESSAGE_LINES]
    innermost = exc
    while innermost.__cause__ is not None or innermost.__context__ is not None:
        innermost = innermost.__cause__ or innermost.__context__
    if innermost is not exc:
        inner_message = (str(innermost).strip().splitlines() or [""])[0]
        lines.append(f"innermost: {type(innermost).__name__}: {inner_message}")
    for frame in traceback.extract_tb(innermost.__traceback__)[-ERROR_FRAMES:]:
        lines.append(f"  {frame.filename}:{frame.lineno} in {frame.name}: {frame.line}")
    lines.append("```")
    return lines


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- environment -------------------------------------------------------------------------------


def _cpu_name() -> str:
    try:
        for text_line in Path("/proc/cpuinfo").read_text().splitlines():
            if text_line.startswith("model name"):
                return text_line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _optional_version(module_name: str) -> str:
    try:
        module = __import__(module_name)
    except Exception as exc:  # any import failure (missing CUDA deps included) means "not usable"
        return f"not importable ({type(exc).__name__})"
    return str(getattr(module, "__version__", "version unknown"))


def environment_section(device: torch.device) -> Callable[[Report], None]:
    def run(report: Report) -> None:
        import transformers

        report.line(f"- python {platform.python_version()}, {platform.platform()}")
        report.line(
            f"- torch {torch.__version__} (CUDA build {torch.version.cuda}), "
            f"transformers {transformers.__version__}"
        )
        report.line(f"- triton {_optional_version('triton')}, flashinfer {_optional_version('flashinfer')}")
        report.line(f"- CPU: {_cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
        report.line(
            f"- TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(Inductor default)')}"
        )
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
            report.line(
                f"- device: {props.name}, capability {props.major}.{props.minor}, "
                f"{props.multi_processor_count} SMs"
            )
            report.line(f"- device memory: {total / 2**30:.1f} GiB total, {free / 2**30:.1f} GiB free")
        else:
            pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            report.line(f"- device: cpu, {pages * page_size / 2**30:.1f} GiB RAM")

    return run


def backends_section(device: torch.device, quick: bool) -> Callable[[Report], None]:
    """Each attention backend (kernels/backends.py) against the reference op (bench/gpu_attention.py)."""

    def run(report: Report) -> None:
        from bench import gpu_attention

        for name, version in gpu_attention.available_backends(device).items():
            report.line(f"- {name}: {version}")
        report.line(
            "- CUDA graphs (decode bucket capture): one per decode bucket (graphs/decode_graphs.py on "
            "graphs/device.py); checked standalone below and by the compiled parity cases and timings"
        )
        report.line("")
        cases = gpu_attention.QUICK_PARITY_CASES if quick else gpu_attention.PARITY_CASES
        shape = gpu_attention.SMALL_SHAPE if quick or device.type != "cuda" else gpu_attention.GPU_SHAPE
        lines, failures = gpu_attention.parity_lines(device, shape, cases)
        for line in lines:
            report.line(line)
        if failures:
            raise AssertionError(f"attention backends differ from the reference: {failures}")

    return run


def attention_timing_section(device: torch.device, quick: bool) -> Callable[[Report], None]:
    """Decode attention per backend, batch x context, with achieved bandwidth (bench/gpu_attention.py)."""

    def run(report: Report) -> None:
        from bench import gpu_attention

        if device.type == "cuda" and not quick:
            shape, batches, contexts = (
                gpu_attention.GPU_SHAPE,
                gpu_attention.GPU_BATCHES,
                gpu_attention.GPU_CONTEXTS,
            )
            dtype, bandwidth, calls = torch.bfloat16, gpu_attention.copy_bandwidth_gb_s(device), 20
        else:  # exercises the code path; CPU numbers of an interpreted kernel mean nothing
            from bench.floors import measure_memory_read

            shape, batches, contexts = gpu_attention.SMALL_SHAPE, (1, 4), (64,)
            dtype, bandwidth, calls = torch.float32, measure_memory_read(64 << 20, repeats=2), 2
        for line in gpu_attention.decode_timing_lines(
            device, shape, batches, contexts, dtype, bandwidth, calls
        ):
            report.line(line)

    return run


def kv_quant_section(device: torch.device, quick: bool) -> Callable[[Report], None]:
    """The int8 / fp8 KV cache (#21) on each backend: parity with the reference op on the same
    quantized cache, and decode attention time against the unquantized cache (bench/gpu_attention.py)."""

    def run(report: Report) -> None:
        from bench import gpu_attention

        on_gpu = device.type == "cuda" and not quick
        shape = gpu_attention.GPU_SHAPE if on_gpu else gpu_attention.SMALL_SHAPE
        cases = (
            gpu_attention.PARITY_CASES
            if on_gpu
            else {"sliding window": gpu_attention.PARITY_CASES["sliding window"]}
        )
        lines, failures = gpu_attention.kv_quant_parity_lines(device, shape, cases)
        for line in lines:
            report.line(line)
        report.line("")
        batches, contexts = ((64, 256), (2048, 8192)) if on_gpu else ((2,), (64,))
        for line in gpu_attention.kv_quant_timing_lines(
            device, shape, batches, contexts, 20 if on_gpu else 2
        ):
            report.line(line)
        if failures:
            raise AssertionError(f"quantized KV cache differs from the reference: {failures}")

    return run


# -- bucket graphs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToyDims:
    vocab: int
    hidden: int
    ffn: int
    layers: int
    context: int  # cache rows each token attends over, gathered through its index-table row
    cache_rows: int


TOY_DIMS = ToyDims(vocab=4096, hidden=256, ffn=1024, layers=2, context=32, cache_rows=4096)
QUICK_TOY_DIMS = ToyDims(vocab=256, hidden=32, ffn=64, layers=1, context=8, cache_rows=256)


def _toy_step(
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    context: torch.Tensor,
    cache: torch.Tensor,
    emb: torch.Tensor,
    pos_emb: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    x = emb[ids] + pos_emb[positions]
    # In place into a persistent cache, like the KV write: the graph must mutate the real buffer.
    cache.index_copy_(0, slots, x)
    keys = cache[context]  # [T, C, H], like a block-table gather (this step's rows included)
    scores = (keys @ x[:, :, None]).squeeze(-1) / math.sqrt(x.shape[-1])
    x = x + (torch.softmax(scores, dim=-1)[:, :, None] * keys).sum(1)
    for layer in range(w_up.shape[0]):
        x = x + torch.nn.functional.silu(x @ w_up[layer]) @ w_down[layer]
    return x @ emb.T


class ToyStep:
    """A small decode-shaped step on persistent buffers, compiled by Inductor per bucket.

    It stands in for the engine's compiled step (which needs a capture-safe paged-attention
    write before it can be captured): inputs are views at the front of whole buffers, updated
    in place, and the step writes into a cache and gathers from it through an index table.
    """

    def __init__(self, dims: ToyDims, max_tokens: int, device: torch.device) -> None:
        self.dims = dims
        self.device = device
        gen = torch.Generator().manual_seed(PROMPT_SEED)

        def param(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])).to(device)

        self.weights = (
            param(dims.vocab, dims.hidden),
            param(max_tokens, dims.hidden),
            param(dims.layers, dims.hidden, dims.ffn),
            param(dims.layers, dims.ffn, dims.hidden),
        )
        self.ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.arange(max_tokens, dtype=torch.int64, device=device)
        self.context = torch.zeros(max_tokens, dims.context, dtype=torch.int64, device=device)
        self.cache = torch.zeros(dims.cache_rows, dims.hidden, device=device)
        # One Dynamo entry per bucket shape, called directly afterwards as the engine calls its
        # artifacts; failing on the recompile limit rules out a silent fall-back to eager.
        self._compiled = torch.compile(_toy_step, fullgraph=True, dynamic=False)

    def fill(self, seed: int) -> None:
        """New input values, written in place into the persistent buffers."""
        gen = torch.Generator().manual_seed(seed)
        n, dims = self.ids.shape[0], self.dims
        self.ids.copy_(torch.randint(dims.vocab, (n,), generator=gen))
        self.positions.copy_(torch.randint(n, (n,), generator=gen))
        # Distinct slots: index_copy_ with a repeated index has no defined winner.
        self.slots.copy_(torch.randperm(dims.cache_rows, generator=gen)[:n])
        self.context.copy_(torch.randint(dims.cache_rows, (n, dims.context), generator=gen))
        self.cache.copy_(torch.randn(dims.cache_rows, dims.hidden, generator=gen))

    def fn(self, bucket: int) -> Callable[[], torch.Tensor]:
        views = (self.ids[:bucket], self.positions[:bucket], self.slots[:bucket], self.context[:bucket])
        compiled, cache, weights = self._compiled, self.cache, self.weights

        def step() -> torch.Tensor:
            with torch.no_grad():
                return compiled(*views, cache, *weights)

        return step


def _median_call_ms(call: Callable[[], object], runtime: DeviceRuntime, calls: int) -> float:
    times = []
    for _ in range(calls):
        runtime.synchronize()
        started = time.perf_counter()
        call()
        runtime.synchronize()
        times.append(time.perf_counter() - started)
    return _median_ms(times)


def _format_bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.0f} KiB"


def bucket_graphs_section(device: torch.device, quick: bool) -> Callable[[Report], None]:
    def run(report: Report) -> None:
        from compiled_engine.graphs.bucket_graphs import BucketGraphs
        from compiled_engine.graphs.device import runtime_for

        buckets = QUICK_GRAPH_BUCKETS if quick else GRAPH_BUCKETS
        calls = QUICK_GRAPH_TIMED_CALLS if quick else GRAPH_TIMED_CALLS
        dims = QUICK_TOY_DIMS if quick else TOY_DIMS
        runtime = runtime_for(device)
        toy = ToyStep(dims, max(buckets), device)
        toy.fill(seed=0)
        report.line(
            f"- runtime {type(runtime).__name__} (device graphs: {runtime.supports_graphs}); toy step "
            f"{dims}, fp32, Inductor per bucket; buckets {buckets}; median of {calls} calls"
        )
        compile_s: dict[int, float] = {}
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for bucket in buckets:
                started = time.perf_counter()
                toy.fn(bucket)()
                runtime.synchronize()
                compile_s[bucket] = time.perf_counter() - started
            # Cached blocks left by the compiles would be released by the first capture and
            # hide part of what the captures add.
            _release_memory()
            memory_before = runtime.memory_in_use()
            graphs = BucketGraphs(runtime, buckets)
            graphs.capture_all(toy.fn)
            memory_added = runtime.memory_in_use() - memory_before

        report.line(f"- capture order: {list(graphs.captured_buckets)}")
        report.line("")
        report.line(
            "| bucket | compile s | capture s | graph memory | plain ms | replay ms | speedup | max diff |"
        )
        report.line("|---|---|---|---|---|---|---|---|")
        failures: list[str] = []
        for bucket in buckets:
            fn = toy.fn(bucket)
            diffs, plains = [], []
            # Two rounds of new buffer contents: a replay that ignored the in-place update would
            # return the first round's logits in the second.
            for round_seed in (1, 2):
                toy.fill(seed=1000 * bucket + round_seed)
                plain = fn().clone()
                replayed = graphs.replay(bucket).clone()
                runtime.synchronize()
                diffs.append(float((plain - replayed).abs().max()))
                plains.append(plain)
            if torch.equal(plains[0], plains[1]):
                failures.append(f"bucket {bucket}: new inputs did not change the output (check is vacuous)")
            scale = max(1.0, max(float(p.abs().max()) for p in plains))
            if max(diffs) > GRAPH_TOLERANCE * scale:
                failures.append(f"bucket {bucket}: replay differs from the plain call by {max(diffs):.3g}")
            plain_ms = _median_call_ms(fn, runtime, calls)
            replay_ms = _median_call_ms(lambda b=bucket: graphs.replay(b), runtime, calls)
            report.line(
                f"| {bucket} | {compile_s[bucket]:.1f} | {graphs.capture_seconds[bucket]:.2f} | "
                f"{_format_bytes(graphs.graph_memory[bucket])} | {plain_ms:.3f} | {replay_ms:.3f} | "
                f"{plain_ms / replay_ms:.2f}x | {max(diffs):.2g} |"
            )
        report.line("")
        report.line(
            f"- graph memory total {_format_bytes(graphs.memory_bytes)} (sum per bucket); reserved by "
            f"the allocator across the captures {_format_bytes(memory_added)}"
        )
        for failure in failures:
            report.line(f"- MISMATCH {failure}")
        if failures:
            raise RuntimeError(f"{len(failures)} bucket graph check(s) failed")

    return run


# -- parity ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParityModel:
    label: str
    path: Path


@dataclass
class Comparison:
    identical: int = 0
    excused: int = 0
    unexcused: list[str] = field(default_factory=list)
    worst_excused_gap: float = 0.0


def random_prompts(vocab_size: int, count: int, seed: int = PROMPT_SEED) -> list[list[int]]:
    """`count` prompts of 1..MAX_PROMPT_LEN random tokens; the extremes always included."""
    rng = random.Random(seed)
    lengths = [1, MAX_PROMPT_LEN] + [rng.randint(1, MAX_PROMPT_LEN) for _ in range(count - 2)]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths[:count]]


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def hf_reference(model_dir: Path, dtype: str, device: torch.device, prompts: list[list[int]]):
    """Per prompt, alone: transformers' greedy tokens and the scores (logits) of every step."""
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
    )
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            refs.append((tokens, [s[0].float().cpu() for s in out.scores]))
    del model
    return refs


def tie_tolerance(dtype: str, top_logit: float) -> float:
    """The widest top-2 gap at which a divergence counts as a rounding near-tie."""
    if dtype != "bfloat16":
        return TIE_TOLERANCE[dtype]
    # bf16 keeps 8 significant bits: one ulp of x is 2**(floor(log2|x|) - 7).
    ulp = 2.0 ** (math.floor(math.log2(max(abs(top_logit), 2.0**-60))) - 7)
    return max(TIE_TOLERANCE[dtype], TIE_ULPS_BF16 * ulp)


def compare(outputs: list[list[int]], prompts: list[list[int]], refs, dtype: str) -> Comparison:
    """Count identical prompts, excused near-tie divergences and unexcused ones (with details)."""
    result = Comparison()
    for i, (ours, (ref_tokens, ref_scores)) in enumerate(zip(outputs, refs, strict=True)):
        if len(ours) != len(ref_tokens):
            result.unexcused.append(f"prompt {i}: {len(ours)} tokens, transformers {len(ref_tokens)}")
            continue
        for step, (a, b) in enumerate(zip(ours, ref_tokens, strict=True)):
            if a == b:
                continue
            top2 = torch.topk(ref_scores[step], 2).values
            gap = float(top2[0] - top2[1])
            tolerance = tie_tolerance(dtype, float(top2[0]))
            if gap <= tolerance:
                result.excused += 1
                result.worst_excused_gap = max(result.worst_excused_gap, gap)
            else:
                result.unexcused.append(
                    f"prompt {i} (len {len(prompts[i])}) step {step}: ours {a}, transformers {b}, "
                    f"top-2 gap {gap:.3g} > tolerance {tolerance:.3g}"
                )
            break  # after a divergence the continuations are no longer comparable
        else:
            result.identical += 1
    return result


def _tolerance_rule(dtype: str) -> str:
    if dtype == "bfloat16":
        return f"max({TIE_TOLERANCE[dtype]:g}, {TIE_ULPS_BF16} bf16 ulps of the top logit)"
    return f"{TIE_TOLERANCE[dtype]:g}"


def _parity_engine_kwargs(compile_buckets: tuple[int, ...] | None) -> dict:
    kwargs = {
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": PARITY_MAX_NUM_SEQS,
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": PARITY_MAX_NUM_SEQS * (MAX_MODEL_LEN // BLOCK_SIZE) + 1,
    }
    if compile_buckets is None:
        return {**kwargs, "enforce_eager": True, "max_num_batched_tokens": EAGER_MAX_NUM_BATCHED_TOKENS}
    # A step budget equal to the largest bucket keeps every step (chunked prefill included) inside
    # the buckets: the dynamic graph is never needed, which saves its cold compile.
    return {
        **kwargs,
        "enforce_eager": False,
        "compile_buckets": compile_buckets,
        "max_num_batched_tokens": max(compile_buckets),
    }


class ParityRunner:
    """Runs parity cases; transformers' references are computed once per (model, dtype)."""

    def __init__(self, device: torch.device, num_prompts: int) -> None:
        self.device = device
        self.num_prompts = num_prompts
        self._refs: dict[tuple[str, str], tuple[list[list[int]], list]] = {}

    def _prompts_and_refs(self, model: ParityModel, dtype: str):
        key = (model.label, dtype)
        if key not in self._refs:
            prompts = random_prompts(_vocab_size(model.path), self.num_prompts)
            self._refs[key] = (prompts, hf_reference(model.path, dtype, self.device, prompts))
        return self._refs[key]

    def section(self, model: ParityModel, dtype: str, compile_buckets: tuple[int, ...] | None) -> Section:
        mode = "eager" if compile_buckets is None else "compiled"
        title = f"parity {model.label} {dtype} {mode}"

        def run(report: Report) -> None:
            from compiled_engine import LLM, SamplingParams

            started = time.perf_counter()
            prompts, refs = self._prompts_and_refs(model, dtype)
            ref_s = time.perf_counter() - started
            started = time.perf_counter()
            llm = LLM(
                str(model.path),
                dtype=dtype,
                device=str(self.device),
                **_parity_engine_kwargs(compile_buckets),
            )
            start_s = time.perf_counter() - started
            params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
            started = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            gen_s = time.perf_counter() - started
            result = compare([list(o.outputs[0].token_ids) for o in outputs], prompts, refs, dtype)
            leaked = llm.engine.num_kv_blocks - llm.engine.num_free_kv_blocks()
            report.line(
                f"- {title}: {len(prompts)} prompts, {result.identical} identical, "
                f"{result.excused} excused near-ties (worst gap {result.worst_excused_gap:.2g}), "
                f"{len(result.unexcused)} unexcused divergences (tie tolerance {_tolerance_rule(dtype)})"
            )
            for detail in result.unexcused:
                report.line(f"  - UNEXCUSED {detail}")
            report.line(
                f"- times: transformers reference {ref_s:.1f} s, engine start {start_s:.1f} s, "
                f"generate {gen_s:.2f} s"
            )
            compiled = _compiled_step(llm)
            if compiled is not None:
                report.line(f"- compile s per bucket: {_format_compile_seconds(compiled.compile_seconds)}")
            if leaked:
                report.line(f"- KV blocks still held after generate: {leaked}")
            if result.unexcused or leaked:
                report.parity_failures.append(title)
            del llm

        return Section(title, PARITY_SECTION, run)


def tensor_parallel_section(
    models: list[ParityModel], device: torch.device, quick: bool
) -> Callable[[Report], None]:
    """Greedy outputs of tensor_parallel_size=2 against one rank (compiled), on NCCL or gloo."""

    def run(report: Report) -> None:
        from compiled_engine import LLM

        if device.type == "cuda" and torch.cuda.device_count() < 2:
            report.line(f"- skipped: TP=2 needs 2 GPUs, this machine has {torch.cuda.device_count()}")
            return
        model = models[0]
        prompts, params, buckets = _two_size_parity_inputs(model, quick)
        outputs = {}
        # A compile cache of its own: the sections after this one time cold compiles.
        with tempfile.TemporaryDirectory(prefix="gpu-check-tp-cache-") as cache_dir:
            for size in (1, 2):
                started = time.perf_counter()
                llm = LLM(
                    str(model.path),
                    device=str(device),
                    tensor_parallel_size=size,
                    cache_dir=cache_dir,
                    **_parity_engine_kwargs(buckets),
                )
                try:
                    generated = llm.generate(prompts, params, use_tqdm=False)
                finally:
                    llm.close()
                outputs[size] = [list(o.outputs[0].token_ids) for o in generated]
                seconds = time.perf_counter() - started
                report.line(f"- {model.label} fp32 compiled, TP={size}: start + generate {seconds:.1f} s")
                del llm
        _require_identical(report, "TP", "one rank's", outputs)

    return run


def pipeline_parallel_section(
    models: list[ParityModel], device: torch.device, quick: bool
) -> Callable[[Report], None]:
    """Greedy outputs of pipeline_parallel_size=2 (compiled; stage s on cuda:s) against one
    process, on NCCL or gloo, and each stage's busy share of the generate call."""

    def run(report: Report) -> None:
        from compiled_engine import LLM

        if device.type == "cuda" and torch.cuda.device_count() < 2:
            report.line(f"- skipped: PP=2 needs 2 GPUs, this machine has {torch.cuda.device_count()}")
            return
        model = models[0]
        prompts, params, buckets = _two_size_parity_inputs(model, quick)
        outputs = {}
        with tempfile.TemporaryDirectory(prefix="gpu-check-pp-cache-") as cache_dir:
            for size in (1, 2):
                started = time.perf_counter()
                llm = LLM(
                    str(model.path),
                    device=str(device),
                    pipeline_parallel_size=size,
                    cache_dir=cache_dir,
                    **_parity_engine_kwargs(buckets),
                )
                try:
                    if size > 1:
                        llm.engine.pipeline_stage_times(reset=True)
                    generate_started = time.perf_counter()
                    generated = llm.generate(prompts, params, use_tqdm=False)
                    wall = time.perf_counter() - generate_started
                    if size > 1:
                        busy = ", ".join(
                            f"stage {t.stage} busy {t.busy_s / wall:.0%} waiting {t.wait_s / wall:.0%}"
                            for t in llm.engine.pipeline_stage_times()
                        )
                        report.line(f"- PP=2 generate {wall:.2f} s: {busy}")
                finally:
                    llm.close()
                outputs[size] = [list(o.outputs[0].token_ids) for o in generated]
                seconds = time.perf_counter() - started
                report.line(f"- {model.label} fp32 compiled, PP={size}: start + generate {seconds:.1f} s")
                del llm
        _require_identical(report, "PP", "one process's", outputs)

    return run


def _two_size_parity_inputs(model: ParityModel, quick: bool) -> tuple[list[dict], Any, tuple[int, ...]]:
    """The prompts, greedy sampling settings and buckets the TP and PP sections run at size 1 and 2."""
    from compiled_engine import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in random_prompts(_vocab_size(model.path), 4 if quick else 16)]
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return prompts, params, QUICK_COMPILE_BUCKETS if quick else COMPILE_BUCKETS


def _require_identical(report: Report, kind: str, baseline: str, outputs: dict[int, list]) -> None:
    """Report how many of size 2's greedy outputs equal size 1's; any difference fails the check."""
    same = sum(a == b for a, b in zip(outputs[1], outputs[2], strict=True))
    report.line(f"- {kind}=2 vs {kind}=1: {same} of {len(outputs[1])} prompts identical")
    if same != len(outputs[1]):
        raise AssertionError(
            f"{kind}=2 greedy outputs differ from {baseline} in {len(outputs[1]) - same} prompts"
        )


def _format_compile_seconds(seconds: dict[int | None, float]) -> str:
    return (
        ", ".join(f"{'dynamic' if b is None else b}: {s:.1f}" for b, s in seconds.items()) or "none compiled"
    )


# -- timings -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimingPlan:
    model_label: str
    model_dir: Callable[[], Path]  # built lazily: bench-small is built (once) inside the guarded section
    dtype: str
    concurrency: tuple[int, ...]
    buckets: tuple[int, ...]
    warmup_steps: int
    measured_steps: int
    with_compiled: bool = True

    @property
    def max_num_seqs(self) -> int:
        return max(PARITY_MAX_NUM_SEQS, *self.concurrency)

    def engine_kwargs(self, compiled: bool) -> dict:
        kwargs = {
            "dtype": self.dtype,
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": self.max_num_seqs,
            "block_size": BLOCK_SIZE,
            "num_kv_blocks": self.max_num_seqs * (MAX_MODEL_LEN // BLOCK_SIZE) + 1,
            "max_num_batched_tokens": max(self.buckets),
            "enforce_eager": not compiled,
        }
        return {**kwargs, "compile_buckets": self.buckets} if compiled else kwargs


def _median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


HOST_PHASES = ("schedule_s", "prepare_s", "execute_s", "wait_s", "update_s")


def host_phases_line(before, after, steps: int, wall_s: float) -> str:
    """Mean ms per step of each phase of the engine core's timeline (EngineStats), and of what
    the measured steps spent outside the core (output processing: detokenizing, stop strings)."""
    cells = [
        f"{name[:-2]} {(getattr(after, name) - getattr(before, name)) * 1e3 / steps:.3f}"
        for name in HOST_PHASES
    ]
    outside = wall_s - (after.step_wall_s - before.step_wall_s)
    cells.append(f"outside the core {outside * 1e3 / steps:.3f}")
    return "ms per step: " + ", ".join(cells)


def engine_decode_step_times(
    llm, prompts: list[list[int]], plan: TimingPlan, device: torch.device, phases: list[str] | None = None
) -> list[float]:
    """Seconds of each engine step once every request is decoding, after the warm-up steps.

    `phases`: gets one line, the measured steps' host phases (host_phases_line)."""
    from compiled_engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(
        max_tokens=1 + plan.warmup_steps + plan.measured_steps, temperature=0.0, ignore_eos=True
    )
    validated = engine.validate([{"prompt_token_ids": p} for p in prompts], params)
    counts: dict[str, int] = {}
    for processed, request_params in validated:
        request_id = engine.next_request_id()
        engine.add_request(request_id, processed, request_params)
        counts[request_id] = 0
    times: list[float] = []
    before = None
    while engine.has_unfinished_requests():
        decoding = all(n > 0 for n in counts.values())
        if decoding and len(times) == plan.warmup_steps:
            before = engine.stats()
        _sync(device)
        started = time.perf_counter()
        outputs = engine.step()
        _sync(device)
        if decoding:
            times.append(time.perf_counter() - started)
        for out in outputs:
            counts[out.request_id] = len(out.outputs[0].token_ids)
    measured = times[plan.warmup_steps :]
    if phases is not None and before is not None and measured:
        phases.append(host_phases_line(before, engine.stats(), len(measured), sum(measured)))
    return measured


class _StepClock:
    """A logits processor that notes the (synchronised) time: transformers calls it once per token."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        _sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def hf_decode_step_times(
    model, prompts: list[list[int]], plan: TimingPlan, device: torch.device
) -> list[float]:
    from transformers import LogitsProcessorList

    clock = _StepClock(device)
    new_tokens = 1 + plan.warmup_steps + plan.measured_steps
    with torch.inference_mode():
        model.generate(
            torch.tensor(prompts, device=device),  # equal lengths: no padding needed
            attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long, device=device),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
    # times[0]: the prefill's logits; each later interval is one decode step.
    steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    return steps[plan.warmup_steps :]


def _peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"peak allocated {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return f"process peak RSS {rss_kib / 2**10:.0f} MiB (CPU: whole process, not per system)"


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def timing_section(plan: TimingPlan, device: torch.device, budget: Budget) -> Callable[[Report], None]:
    def run(report: Report) -> None:
        from transformers import AutoModelForCausalLM

        from compiled_engine import LLM

        model_dir = plan.model_dir()
        rng = random.Random(PROMPT_SEED)
        vocab = _vocab_size(model_dir)
        prompts = {
            c: [[rng.randrange(3, vocab) for _ in range(TIMING_PROMPT_LEN)] for _ in range(c)]
            for c in plan.concurrency
        }
        report.line(
            f"- model {plan.model_label} ({model_dir}), {plan.dtype}, prompt {TIMING_PROMPT_LEN} tokens, "
            f"median of {plan.measured_steps} decode steps after {plan.warmup_steps} warm-up"
        )
        report.line("")
        report.line(
            "| system | " + " | ".join(f"c={c} ms/step (tok/s)" for c in plan.concurrency) + " | memory |"
        )
        report.line("|---|" + "---|" * (len(plan.concurrency) + 1))
        systems = ["eager"]
        if plan.with_compiled:
            systems.append("compiled")  # the device's default loop: async on CUDA
            systems.append("compiled, sync loop" if device.type == "cuda" else "compiled, async loop")
            if device.type == "cuda":
                systems.append("compiled, no CUDA graphs")
        forward_notes: list[str] = []
        phase_notes: list[str] = []
        compile_notes: list[str] = []
        for system in [*systems, "hf generate"]:
            if budget.exceeded():
                report.line(f"| {system} | skipped: time budget spent |")
                report.skipped.append(f"timings {system}")
                continue
            _reset_peak(device)
            started = time.perf_counter()
            if system == "hf generate":
                runner = AutoModelForCausalLM.from_pretrained(
                    str(model_dir), dtype=getattr(torch, plan.dtype)
                )
                runner = runner.to(device).eval()
                step_times = hf_decode_step_times
            else:
                loop = {"compiled, sync loop": False, "compiled, async loop": True}.get(system)
                runner = LLM(
                    str(model_dir),
                    device=str(device),
                    async_scheduling=loop,
                    **plan.engine_kwargs(system != "eager"),
                )
                compiled = _compiled_step(runner)
                if compiled is not None:
                    # Compile every bucket now, so no measured step pays for a compile.
                    compiled.compile_buckets(list(plan.buckets))
                    compile_notes.append(
                        f"compile s per bucket: {_format_compile_seconds(compiled.compile_seconds)}"
                    )
                    graphs = compiled.decode_graphs.graphs
                    if system == "compiled, no CUDA graphs":
                        runner.engine.model_runner.release_graphs()
                    elif graphs is not None and compiled.runtime.supports_graphs:
                        compile_notes.append(
                            "decode graphs (bucket: capture s, memory): "
                            + ", ".join(
                                f"{b}: {s:.2f} s, {_format_bytes(graphs.graph_memory[b])}"
                                for b, s in graphs.capture_seconds.items()
                            )
                        )
                step_times = engine_decode_step_times
            load_s = time.perf_counter() - started
            cells = []
            for c in plan.concurrency:
                if system == "hf generate":
                    ms = _median_ms(step_times(runner, prompts[c], plan, device))
                else:
                    phases: list[str] = []
                    ms = _median_ms(step_times(runner, prompts[c], plan, device, phases))
                    phase_notes += [f"{system}, c={c}: {line}" for line in phases]
                cells.append(f"{ms:.2f} ({c * 1e3 / ms:.0f})")
                if system == "compiled":
                    forward = _graph_forward_ms(runner, c, plan.buckets, device)
                    if forward is not None:
                        loop = "async" if runner.engine.async_scheduling else "sync"
                        forward_notes.append(
                            f"c={c}: engine step ({loop} loop) {ms:.2f} ms vs its CUDA-graph forward alone "
                            f"{forward:.2f} ms: {100 * (ms / forward - 1):+.1f}% (target at c=64: within +5%)"
                        )
            report.line(
                f"| {system} | " + " | ".join(cells) + f" | {_peak_memory(device)}; ready in {load_s:.1f} s |"
            )
            del runner
            _release_memory()
        report.line("")
        for note in compile_notes:
            report.line(f"- compiled: {note}")
        for note in phase_notes:
            report.line(f"- host phases, {note}")
        for note in forward_notes:
            report.line(f"- {note}")

    return run


def _compiled_step(llm):
    """The engine's CompiledStep (graphs/compiled_step.py), or None on the eager path."""
    from compiled_engine.graphs.compiled_step import CompiledStep

    step = llm.engine.model_runner.step_graph
    return step if isinstance(step, CompiledStep) else None


def _graph_forward_ms(llm, concurrency: int, buckets: tuple[int, ...], device: torch.device) -> float | None:
    """Median ms of replaying the decode graph of `concurrency`'s bucket alone (CUDA graphs only)."""
    from compiled_engine.graphs.buckets import bucket_for

    compiled = _compiled_step(llm)
    graphs = compiled.decode_graphs.graphs if compiled is not None else None
    bucket = bucket_for(concurrency, buckets)
    if graphs is None or bucket is None or not graphs.has(bucket) or device.type != "cuda":
        return None
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay(bucket)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[5:])


def sized_start_section(models: list[ParityModel], device: torch.device) -> Callable[[Report], None]:
    """The engine's own KV sizing: build and capture on a one-block cache, then the real cache."""

    def run(report: Report) -> None:
        from compiled_engine import LLM, SamplingParams

        model = models[0]
        started = time.perf_counter()
        llm = LLM(str(model.path), device=str(device), max_model_len=MAX_MODEL_LEN, max_num_seqs=16)
        ready_s = time.perf_counter() - started
        step = _compiled_step(llm)
        graphs = step.decode_graphs.graphs if step is not None else None
        graph_bytes = graphs.memory_bytes if graphs is not None else 0
        report.line(
            f"- {model.label}: ready in {ready_s:.1f} s, {llm.engine.num_kv_blocks} KV blocks sized "
            f"by the engine (CUDA: from free memory), decode graphs "
            f"{graphs.captured_buckets if graphs else 'none'} holding {_format_bytes(graph_bytes)}"
        )
        prompts = [{"prompt_token_ids": p} for p in random_prompts(_vocab_size(model.path), 8)]
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        if any(len(o.outputs[0].token_ids) != 8 for o in outs):
            raise RuntimeError("a request did not produce its 8 tokens")
        if llm.engine.num_free_kv_blocks() != llm.engine.num_kv_blocks:
            raise RuntimeError("KV blocks leaked after the batch")
        report.line("- 8 requests x 8 tokens generated, every KV block free afterwards")
        del llm
        _release_memory()

    return run


# -- plan --------------------------------------------------------------------------------------


def build_parity_models(root: Path, quick: bool) -> list[ParityModel]:
    from tests.model_factory import make_tiny_model

    archs = ["llama"] if quick else ["llama", "qwen3"]
    models = [ParityModel(f"tiny-{arch}", make_tiny_model(root, arch=arch, seed=1)) for arch in archs]
    if not quick:
        from compiled_engine.default_model_path import default_model_dir

        models.append(ParityModel("embedded", default_model_dir()))
    return models


def plan_sections(
    args: argparse.Namespace, device: torch.device, budget: Budget, model_root: Path
) -> list[Section]:
    sections = [
        Section("1. Environment", "environment", environment_section(device)),
        Section("Attention backends vs the reference", PARITY_SECTION, backends_section(device, args.quick)),
        Section("Attention decode timings", "attention", attention_timing_section(device, args.quick)),
        Section("Quantized KV cache", PARITY_SECTION, kv_quant_section(device, args.quick)),
        # Cheap (a tiny model, seconds per bucket) and the newest device code: before parity.
        Section("Bucket graphs", "graphs", bucket_graphs_section(device, args.quick)),
    ]
    models: list[ParityModel] = []

    def build_models(report: Report) -> None:
        models.extend(build_parity_models(model_root, args.quick))
        report.line(f"- models: {', '.join(f'{m.label} ({m.path})' for m in models)}")

    sections.append(Section("2. Parity models", PARITY_SECTION, build_models))
    sections.append(
        Section("Engine start, KV cache sized by the engine", "start", sized_start_section(models, device))
    )
    sections.append(
        Section(
            "Tensor parallel, 2 ranks vs 1",
            PARITY_SECTION,
            tensor_parallel_section(models, device, args.quick),
        )
    )
    sections.append(
        Section(
            "Pipeline parallel, 2 stages vs 1",
            PARITY_SECTION,
            pipeline_parallel_section(models, device, args.quick),
        )
    )
    dtypes = ["float32"] if args.quick else ["float32", "bfloat16"]
    buckets = QUICK_COMPILE_BUCKETS if args.quick else COMPILE_BUCKETS
    runner = ParityRunner(device, QUICK_NUM_PROMPTS if args.quick else NUM_PROMPTS)
    labels = ["tiny-llama"] if args.quick else ["tiny-llama", "tiny-qwen3", "embedded"]

    # Models are built by a section, so cases look their model up when they run.
    def case(label: str, dtype: str, compiled: bool) -> Section:
        def run(report: Report) -> None:
            match = [m for m in models if m.label == label]
            if not match:
                raise RuntimeError(f"model {label} was not built (see the parity models section)")
            runner.section(match[0], dtype, buckets if compiled else None).run(report)

        return Section(f"parity {label} {dtype} {'compiled' if compiled else 'eager'}", PARITY_SECTION, run)

    # Cheap eager cases first, then the first model's compiled cases; timings sit before the
    # remaining compiled cases so a short budget still measures them.
    sections += [case(label, dtype, False) for label in labels for dtype in dtypes]
    compiled_cases = [case(label, dtype, True) for label in labels for dtype in dtypes]
    first_compiled, rest_compiled = compiled_cases[:2], compiled_cases[2:]
    sections += first_compiled

    if args.quick:
        plan = TimingPlan(
            model_label="tiny-llama (--quick: not bench-small)",
            model_dir=lambda: next(m.path for m in models if m.label == "tiny-llama"),
            dtype="float32",
            concurrency=(1,),
            buckets=QUICK_COMPILE_BUCKETS,
            warmup_steps=QUICK_TIMING_WARMUP_STEPS,
            measured_steps=QUICK_TIMING_MEASURED_STEPS,
        )
    else:
        from bench.models import bench_small_dir

        plan = TimingPlan(
            model_label="bench-small",
            model_dir=bench_small_dir,
            dtype=args.timing_dtype or ("bfloat16" if device.type == "cuda" else "float32"),
            concurrency=TIMING_CONCURRENCY,
            buckets=TIMING_BUCKETS,
            warmup_steps=TIMING_WARMUP_STEPS,
            measured_steps=TIMING_MEASURED_STEPS,
        )
    sections.append(Section("3. Decode timings", "timings", timing_section(plan, device, budget)))
    return select_sections(sections + rest_compiled, args.only)


# Always run: the environment is the report's header, and parity cases read the models it builds.
ALWAYS_RUN = ("1. Environment", "2. Parity models")


def select_sections(sections: list[Section], only: str | None) -> list[Section]:
    """Keep the sections whose title contains one of `only`'s comma-separated words (any case).

    For a second, shorter device call that reruns only what failed in the first.
    """
    if not only:
        return sections
    words = [w.strip().lower() for w in only.split(",") if w.strip()]
    return [s for s in sections if s.title in ALWAYS_RUN or any(w in s.title.lower() for w in words)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    parser.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="skip sections started after this"
    )
    parser.add_argument("--quick", action="store_true", help="CPU smoke sizes: tiny llama fp32, 4 prompts")
    parser.add_argument("--timing-dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated words: run only sections whose title contains one (e.g. 'graphs,qwen3')",
    )
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    budget = Budget(args.budget_s)
    report = Report(args.out)
    report.line("# compiled-engine device check")
    report.line(f"- command: `python -m bench.gpu_check {' '.join(sys.argv[1:] if argv is None else argv)}`")
    report.line(f"- device {device}, quick={args.quick}, budget {args.budget_s:.0f} s")
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-check-models-") as model_root:
            run_sections(plan_sections(args, device, budget, Path(model_root)), report, budget)
        report.line("\n## Summary")
        report.line(
            f"- parity failures: {len(report.parity_failures)} {report.parity_failures or ''}".rstrip()
        )
        report.line(
            f"- other section errors: {len(report.section_errors)} {report.section_errors or ''}".rstrip()
        )
        report.line(f"- skipped for the time budget: {len(report.skipped)} {report.skipped or ''}".rstrip())
        report.line(f"- total {budget.elapsed():.0f} s")
    finally:
        report.close()
    if report.parity_failures:
        return 1
    return 2 if report.section_errors else 0


if __name__ == "__main__":
    sys.exit(main())
