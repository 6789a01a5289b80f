"""Engine-wide settings, resolved once from the user's `EngineArgs`, the device and the model's config
(`EngineArgs.create_engine_config`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_engine.records.weight_quantization import WeightQuantization
from compiled_engine.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    """Every option with nothing left to decide, but the KV block count: that is sized from the
    memory the runner leaves, after the runner is built from this config (`LLMEngine.num_kv_blocks`)."""

    model_dir: str
    dtype: torch.dtype  # the model's, after `dtype="auto"` was resolved against its checkpoint
    device: torch.device  # with this rank's CUDA index under tensor parallelism
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    # How to size the KV cache: a fixed block count, else a byte budget, else the device decides.
    num_kv_blocks_override: int | None
    kv_cache_memory: int | None
    # "auto" (the model's dtype), "int8" or "fp8" (e4m3): the cache's codes (kernels/kv_quant.py).
    kv_cache_dtype: str
    seed: int
    enforce_eager: bool
    compile_buckets: tuple[int, ...]  # ascending; empty when eager (nothing is compiled)
    compile_policy: str  # "background", "blocking" or "ahead" (engine_args.py); unused when eager
    fuse_linears: bool
    cache_dir: str | None
    # CPU decode buckets up to this many tokens replay a recorded plan (graphs/cpu_step_plan.py).
    max_cpu_plan_tokens: int
    async_scheduling: bool
    # Decode steps a schedule runs back to back when every running request decodes greedily.
    num_scheduler_steps: int
    # The name asked for ("auto" too): the runner resolves it, as a backend may build a kernel.
    attention_backend: str
    enable_prefix_caching: bool
    long_prefill_token_threshold: int  # 0: a prefill takes up to the step budget
    tensor_parallel_size: int
    # CPU cores left to other work (worker/cpu_cores.py): the background compiler is pinned there.
    cpu_reserved_cores: int = 0
    speculative: SpeculativeConfig | None = None  # speculative decoding; None: off
    # Weight-only quantization of the linears (records/weight_quantization.py); None: the model dtype.
    quantization: WeightQuantization | None = None
