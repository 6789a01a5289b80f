"""Hardware floors: how fast a decode step could possibly be on this machine, measured, not quoted.

Batch-1 decode has to read every weight once per token, so its floor is weight bytes / memory
bandwidth. A batch-B decode step also reads the KV cache and does 2 FLOPs per weight per sequence,
so its floor is the larger of (weights + KV bytes) / bandwidth and FLOPs / GEMM rate.

Run `python -m bench.floors MODEL_DIR` to print them for one model.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# The suites run fp32 whatever the checkpoint stores (the embedded model ships bf16): the floors
# count the bytes actually read at run time.
RUN_DTYPE_BYTES = 4


@dataclass(frozen=True)
class HardwareRates:
    memory_read_gb_s: float  # streaming read of a buffer far larger than the caches
    gemm_fp32_gflop_s: float  # square fp32 matmul
    threads: int


def _best_seconds(fn, repeats: int) -> float:
    fn()  # first touch / allocation out of the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # The best run is the hardware's capability; slower ones measured interference.
    return min(times)


def measure_memory_read(num_bytes: int = 512 * 1024 * 1024, repeats: int = 5) -> float:
    """GB/s for a parallel sum over a fp32 buffer of `num_bytes` (reads each byte once)."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    seconds = _best_seconds(lambda: buffer.sum(), repeats)
    return num_bytes / seconds / 1e9


def measure_gemm(size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a fp32 [size, size] @ [size, size] matmul."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    seconds = _best_seconds(lambda: torch.mm(a, b), repeats)
    return 2 * size**3 / seconds / 1e9


def measure_rates() -> HardwareRates:
    return HardwareRates(
        memory_read_gb_s=measure_memory_read(),
        gemm_fp32_gflop_s=measure_gemm(),
        threads=torch.get_num_threads(),
    )


def _tensor_elements(model_dir: Path) -> dict[str, int]:
    """name -> element count for every tensor in the model's safetensors files."""
    from safetensors import safe_open

    sizes = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                elements = 1
                for dim in tensor_slice.get_shape():
                    elements *= dim
                sizes[name] = elements
    if not sizes:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return sizes


def model_floors(model_dir: Path, rates: HardwareRates, *, batch: int, context: int) -> dict:
    """Floors for one model at batch 1 and at `batch` sequences of `context` tokens each."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    sizes = _tensor_elements(model_dir)
    tied = bool(config.get("tie_word_embeddings", False)) or not any("lm_head" in n for n in sizes)
    # A token reads one row of the embedding table, unless the table doubles as the LM head.
    read_bytes = RUN_DTYPE_BYTES * sum(e for n, e in sizes.items() if "embed_tokens" not in n or tied)
    # Matmul weights: 2 FLOPs per element per token. Norms are vectors; the embedding is a lookup.
    matmul_elements = sum(
        e for n, e in sizes.items() if n.endswith(".weight") and "norm" not in n and "embed" not in n
    )
    if tied:
        matmul_elements += sizes[next(n for n in sizes if "embed_tokens" in n)]

    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_bytes_per_seq = 2 * layers * kv_heads * head_dim * context * RUN_DTYPE_BYTES
    attention_flops_per_token = 2 * 2 * layers * heads * head_dim * context  # QK^T and PV

    bandwidth = rates.memory_read_gb_s * 1e9
    gemm = rates.gemm_fp32_gflop_s * 1e9
    batch1_ms = (read_bytes + kv_bytes_per_seq) / bandwidth * 1e3
    memory_ms = (read_bytes + batch * kv_bytes_per_seq) / bandwidth * 1e3
    compute_ms = batch * (2 * matmul_elements + attention_flops_per_token) / gemm * 1e3
    step_ms = max(memory_ms, compute_ms)
    return {
        "weight_bytes_read_per_step": read_bytes,
        "matmul_params": matmul_elements,
        "context": context,
        "batch1_decode_floor_ms_per_token": batch1_ms,
        "batch1_decode_ceiling_tokens_per_s": 1e3 / batch1_ms,
        "batch": batch,
        "batch_memory_floor_ms_per_step": memory_ms,
        "batch_compute_floor_ms_per_step": compute_ms,
        "batch_decode_floor_ms_per_step": step_ms,
        "batch_decode_ceiling_tokens_per_s": batch * 1e3 / step_ms,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe_machine() -> dict:
    import transformers

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity,
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m bench.floors MODEL_DIR", file=sys.stderr)
        return 2
    rates = measure_rates()
    result = {"rates": asdict(rates), "floors": model_floors(Path(argv[0]), rates, batch=64, context=96)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
