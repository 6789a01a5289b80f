"""One timed run of a workload on each system: our engine, and Hugging Face `generate` as the baseline.

Both sides run greedy, fp32, with the same weights, and always produce exactly the requested number
of tokens (ours: `ignore_eos`; HF: `min_new_tokens == max_new_tokens`), so token counts match.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.workloads import BenchRequest, hf_batches


@dataclass(frozen=True)
class RunResult:
    elapsed_s: float
    tokens_generated: int
    # From the moment every request had its first token to the last token: pure decode time.
    decode_s: float | None = None
    decode_steps: int | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token of one request (= one decode step, all requests advancing together)."""
        if self.decode_s is None or not self.decode_steps:
            return None
        return self.decode_s / self.decode_steps


@dataclass(frozen=True)
class EngineSettings:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    block_size: int = 16

    def as_kwargs(self) -> dict:
        return {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
        }


def engine_settings(max_positions: int, longest_request: int, max_concurrency: int, prefill_tokens: int):
    """Engine limits sized to the workloads: every concurrency level runs at once."""
    block_size = 16
    # Capped at the model's context: workloads that cannot fit are cut or skipped by their suite.
    max_model_len = min(max_positions, block_size * math.ceil(longest_request / block_size))
    return EngineSettings(
        max_model_len=max_model_len,
        max_num_seqs=max_concurrency,
        # Room for a whole decode batch's prompts in one step, so decoding starts together.
        max_num_batched_tokens=max(2048, prefill_tokens, max_model_len),
        num_kv_blocks=max_concurrency * math.ceil(max_model_len / block_size),
        block_size=block_size,
    )


def load_engine(model_dir: Path, settings: EngineSettings, dtype: str = "float32", **options):
    """Our engine; a bucket graph is built the first time a step needs it (in a suite's warm-up
    round), never swapped in by a background compile in the middle of the timed rounds."""
    from compiled_engine import LLM

    options.setdefault("compile_policy", "blocking")
    return LLM(model=str(model_dir), dtype=dtype, **settings.as_kwargs(), **options)


def _bench_params(max_tokens: int, temperature: float = 0.0):
    """The suites' request parameters: greedy, or a plain temperature draw where one is asked for."""
    from compiled_engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)


def _check_lengths(got: list[int], requests: list[BenchRequest], system: str) -> None:
    wanted = [r.output_len for r in requests]
    if got != wanted:
        raise AssertionError(f"{system} produced {got} tokens per request, wanted {wanted}")


def run_engine_generate(llm, requests: list[BenchRequest]) -> RunResult:
    """All requests through `LLM.generate` (continuous batching decides the steps)."""
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [_bench_params(r.output_len) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    _check_lengths(lengths, requests, "our engine")
    return RunResult(elapsed, sum(lengths))


def run_engine_decode(llm, requests: list[BenchRequest], temperature: float = 0.0) -> RunResult:
    """Requests added together, stepped by hand so the decode phase can be timed on its own
    (greedy, or drawn at `temperature`)."""
    engine = llm.engine
    validated = engine.validate(
        [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
        [_bench_params(r.output_len, temperature) for r in requests],
    )
    start = time.perf_counter()
    lengths: dict[str, int] = {}
    for processed, params in validated:
        request_id = engine.next_request_id()
        engine.add_request(request_id, processed, params)
        lengths[request_id] = 0
    first_all = None
    at_first: dict[str, int] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            lengths[out.request_id] = len(out.outputs[0].token_ids)
        if first_all is None and all(n > 0 for n in lengths.values()):
            first_all = time.perf_counter()
            at_first = dict(lengths)
    end = time.perf_counter()
    ordered = [lengths[rid] for rid in lengths]
    _check_lengths(ordered, requests, "our engine")
    # Decode steps in the window, counted in tokens: a step of one token per request adds one to
    # every request, a multi-step run (num_scheduler_steps) as many as it ran.
    decode_tokens = max(lengths[rid] - at_first[rid] for rid in lengths)
    return RunResult(end - start, sum(ordered), end - first_all, decode_tokens)


# -- Hugging Face ------------------------------------------------------------------------------


def load_hf(model_dir: Path, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.eval()


def _pad_id(model) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


class _StepClock:
    """A logits processor that only notes the time: HF calls it once per generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def _hf_generate_batch(model, batch: list[BenchRequest], clock: _StepClock | None = None) -> int:
    """One left-padded batch, greedy, exactly max(output_len) new tokens; returns the wanted count."""
    from transformers import LogitsProcessorList

    pad = _pad_id(model)
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r.prompt_token_ids)
        input_ids[row, width - n :] = torch.tensor(r.prompt_token_ids)
        attention_mask[row, width - n :] = 1
    new_tokens = max(r.output_len for r in batch)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
            logits_processor=LogitsProcessorList([clock] if clock is not None else []),
        )
    generated = out.shape[1] - width
    if generated != new_tokens:
        raise AssertionError(f"HF generate produced {generated} new tokens, wanted {new_tokens}")
    # Tokens past a request's own output_len are the price of static batching, not useful output.
    return sum(r.output_len for r in batch)


def run_hf_generate(model, requests: list[BenchRequest], batch_size: int) -> RunResult:
    start = time.perf_counter()
    tokens = sum(_hf_generate_batch(model, batch) for batch in hf_batches(requests, batch_size))
    return RunResult(time.perf_counter() - start, tokens)


def run_hf_decode(model, requests: list[BenchRequest]) -> RunResult:
    """One batch; the step clock splits prefill (to the first token) from decode."""
    if len({r.output_len for r in requests}) != 1:
        raise ValueError("a decode run needs one output length for every request")
    clock = _StepClock()
    start = time.perf_counter()
    tokens = _hf_generate_batch(model, requests, clock)
    end = time.perf_counter()
    # times[0] is when the first token's logits were ready; each later call is one decode step.
    return RunResult(end - start, tokens, clock.times[-1] - clock.times[0], len(clock.times) - 1)
