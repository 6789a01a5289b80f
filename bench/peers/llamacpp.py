"""llama.cpp as a peer: the bench model as GGUF (converted once, cached), llama-batched-bench for the
decode workload and llama-bench-mixed (bench/peers/llamacpp_mixed.cpp) for the throughput one.

llama-batched-bench is llama.cpp's own tool for N sequences of one prompt length decoding together:
it prefills N prompts of `npp` tokens (each its own sequence), then runs `ntg` decode steps of N
tokens. It feeds random token ids and does not sample, so it times the forward passes only. Our
decode workload's round (prompt P -> O greedy tokens) is one prefill, whose logits give the first
token, plus O - 1 decode steps: the same forward work as -npp P -ntg (O - 1).

llama.cpp has no offline tool for requests of mixed lengths; llama-bench-mixed is a small
continuous-batching driver of libllama built beside it (decode tokens first, then prompt chunks up to
the step's token budget, argmax sampling), given the engine limits ours gets.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.peers.spec import GGUF_PYTHON, LLAMACPP_BINARY, PeerSpec
from bench.runners import EngineSettings
from bench.workloads import BenchRequest

GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# Our weight quantization -> llama.cpp's nearest type of the same weights (--bench-quantization):
# Q8_0 (int8, a scale per 32 weights) and Q4_0 (int4, a scale per 32), both by llama-quantize.
GGUF_QUANTIZED_TYPES = {"int8": "q8_0", "int4": "q4_0"}
QUANTIZE_BINARY = "bin/llama-quantize"
# llama.cpp's limit on sequences in one context (LLAMA_MAX_SEQ).
LLAMA_MAX_SEQUENCES = 256
CONVERTER = Path(__file__).with_name("gguf_convert.py")
MIXED_BINARY = "bin/llama-bench-mixed"


@dataclass(frozen=True)
class BatchedBenchRound:
    """One llama-batched-bench line: prefill and decode seconds for `sequences` sequences."""

    sequences: int
    prompt_len: int
    decode_steps: int
    prefill_s: float
    decode_s: float


def gguf_path(spec: PeerSpec, model_dir: Path, dtype: str, quantization: str | None = None) -> Path:
    """The GGUF of `model_dir` in `dtype`, converted on first use into DIR/gguf/; with `quantization`
    ("int8" / "int4"), llama.cpp's Q8_0 / Q4_0 of the same weights instead."""
    if quantization is not None:
        return _quantized_gguf(spec, model_dir, dtype, quantization)
    if dtype not in GGUF_TYPES:
        raise ValueError(
            f"llama.cpp peer: no GGUF type for dtype {dtype!r}; expected one of {list(GGUF_TYPES)}"
        )
    out = spec.path / "gguf" / f"{model_dir.name}-{GGUF_TYPES[dtype]}.gguf"
    if not out.exists():
        argv = [
            str(spec.path / GGUF_PYTHON),
            str(CONVERTER),
            str(spec.path / "src"),
            str(model_dir),
            str(out),
        ]
        done = subprocess.run([*argv, GGUF_TYPES[dtype]], capture_output=True, text=True, timeout=1800)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"GGUF conversion of {model_dir} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            )
    return out


def _quantized_gguf(spec: PeerSpec, model_dir: Path, dtype: str, quantization: str) -> Path:
    """llama-quantize's Q8_0 / Q4_0 of the model's `dtype` GGUF (both from the same float file, so the
    two differ only in the quantization llama.cpp ships; its defaults, the output matrix included)."""
    if quantization not in GGUF_QUANTIZED_TYPES:
        raise ValueError(f"llama.cpp peer: no GGUF type for quantization {quantization!r}")
    kind = GGUF_QUANTIZED_TYPES[quantization]
    out = spec.path / "gguf" / f"{model_dir.name}-{kind}.gguf"
    if out.exists():
        return out
    tool = spec.path / QUANTIZE_BINARY
    if not tool.exists():
        raise RuntimeError(f"llama.cpp peer: {tool} missing (scripts/peers/llamacpp_build.sh builds it)")
    partial = out.with_name(out.name + ".partial")
    argv = [str(tool), str(gguf_path(spec, model_dir, dtype)), str(partial), kind.upper()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode == 0:
        partial.rename(out)  # only when complete: the bench never trusts a half-written GGUF
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"{kind} GGUF of {model_dir} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return out


def batched_bench_argv(
    spec: PeerSpec, gguf: Path, prompt_len: int, decode_steps: int, sequences: int, repeats: int, threads: int
) -> list[str]:
    # Room for every sequence's prompt and decode, rounded up to llama.cpp's 256-cell KV padding.
    context = 256 * math.ceil(sequences * (prompt_len + decode_steps) / 256)
    return [
        str(spec.path / LLAMACPP_BINARY),
        "-m", str(gguf),
        "-c", str(context),
        "-npp", str(prompt_len),
        "-ntg", str(decode_steps),
        "-npl", ",".join([str(sequences)] * repeats),
        "-t", str(threads),
        "-tb", str(threads),
        "--output-format", "jsonl",
    ]  # fmt: skip


def parse_jsonl(stdout: str) -> list[BatchedBenchRound]:
    rounds = []
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        rounds.append(BatchedBenchRound(row["pl"], row["pp"], row["tg"], row["t_pp"], row["t_tg"]))
    return rounds


def run_batched_bench(
    spec: PeerSpec, gguf: Path, prompt_len: int, decode_steps: int, sequences: int, repeats: int, threads: int
) -> list[BatchedBenchRound]:
    # One round more than asked: the JSON lines go through llama.cpp's log thread, and now and then
    # (1 run in 8 here) the last line never reaches the pipe before the process exits. Every round
    # is the same workload, so the first `repeats` that arrive are kept.
    argv = batched_bench_argv(spec, gguf, prompt_len, decode_steps, sequences, repeats + 1, threads)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    # Which of stdout/stderr the log stream uses depends on the build's log setup.
    rounds = (parse_jsonl(done.stdout) or parse_jsonl(done.stderr))[:repeats]
    if done.returncode != 0 or len(rounds) != repeats:
        raise RuntimeError(
            f"{' '.join(argv)} failed (exit {done.returncode}, {len(rounds)} of {repeats} rounds):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return rounds


@dataclass(frozen=True)
class MixedRound:
    elapsed_s: float
    tokens_generated: int
    steps: int


def mixed_argv(
    spec: PeerSpec, gguf: Path, requests_file: Path, settings: EngineSettings, rounds: int, threads: int
):
    return [
        str(spec.path / MIXED_BINARY), str(gguf), str(requests_file), str(threads),
        str(settings.max_model_len), str(min(settings.max_num_seqs, LLAMA_MAX_SEQUENCES)),
        str(settings.max_num_batched_tokens), str(rounds),
    ]  # fmt: skip


def run_mixed(
    spec: PeerSpec,
    gguf: Path,
    requests: list[BenchRequest],
    settings: EngineSettings,
    rounds: int,
    threads: int,
) -> list[MixedRound]:
    with tempfile.NamedTemporaryFile("w", prefix="bench-mixed-", suffix=".txt") as listing:
        for r in requests:
            listing.write(" ".join(map(str, (r.output_len, *r.prompt_token_ids))) + "\n")
        listing.flush()
        argv = mixed_argv(spec, gguf, Path(listing.name), settings, rounds, threads)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=7200)
    found = [MixedRound(**json.loads(line)) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(found) != rounds:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return found


if __name__ == "__main__":
    # Convert by hand: python -m bench.peers.llamacpp DIR MODEL_DIR DTYPE
    if len(sys.argv) != 4:
        sys.exit("usage: python -m bench.peers.llamacpp LLAMACPP_DIR MODEL_DIR {float32,bfloat16}")
    print(gguf_path(PeerSpec("llamacpp", Path(sys.argv[1])), Path(sys.argv[2]), sys.argv[3]))
