"""Every option of the engine, declared once.

`EngineArgs` is what `LLM`, `LLMEngine`, `AsyncLLM`, the CLI and the tensor-parallel workers take;
`ServerArgs` adds the options of `compiled-engine serve`. Each option is one dataclass field: its
default, its help text and (in `option()`) how it looks on the command line. `add_cli_args` makes
the argparse flags from the fields and `from_cli_args` turns parsed flags back into the dataclass,
so adding an option is adding a field (and using it). Values are checked once, when the object is
built. What depends on the device or the model (the device itself, `max_model_len`, the async
loop, the buckets) is resolved later by `create_engine_config` into `EngineConfig` (config.py).

No heavy imports at module level: the CLI builds its parser for every command, even `--help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from compiled_engine.pooler_config import PoolerConfig, parse_pooler_config
from compiled_engine.speculative_config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    import torch

    from compiled_engine.config import EngineConfig
    from compiled_engine.model_loader.model_config import ModelConfig
    from compiled_engine.records.weight_quantization import WeightQuantization

_Args = TypeVar("_Args", bound="EngineArgs")

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
# `async_scheduling=None` picks per device. CUDA: the host prepares step N+1 while the GPU runs
# step N. CPU: off — the model and the host share the same two cores and the GIL, and the bench
# (docs/performance.md, "Async loop") measured the worker-thread loop slower than the synchronous one.
ASYNC_SCHEDULING_DEFAULT = {"cuda": True, "cpu": False}
# `long_prefill_token_threshold=None`: 0 (no cap) in-process; under `compiled-engine serve`, per
# device. CPU: 16 prompt tokens a step while any request decodes, so an arriving prompt lengthens
# the steps of the streams already decoding by a bounded amount (docs/performance.md, "No stalls":
# uncapped, p99 inter-token latency was 5.6-7.7x its median; capped at 32, 3.4-4.2x; at 16,
# 2.5-3.1x on the same machine). CUDA: no cap, as vLLM.
SERVING_LONG_PREFILL_DEFAULT = {"cpu": 16, "cuda": 0}
# kernels/backends.py ATTENTION_BACKENDS (a test keeps the two equal; importing it here costs torch).
ATTENTION_BACKEND_CHOICES = ("auto", "torch", "cpu", "triton", "flashinfer")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# kernels/kv_quant.py KV_CACHE_DTYPES (a test keeps the two equal; importing it here costs torch).
# vLLM's names: "fp8" is fp8 e4m3, and so is its alias "fp8_e4m3".
KV_CACHE_DTYPE_CHOICES = ("auto", "int8", "fp8", "fp8_e4m3")
# Attention backends that read a quantized KV cache (kernels/backends.py).
QUANTIZED_KV_BACKENDS = ("auto", "torch", "cpu", "triton")
# records/weight_quantization.py WEIGHT_QUANTIZATION_SCHEMES (a test keeps the two equal).
QUANTIZATION_CHOICES = ("int8", "int4")
# What a step does when its bucket's graph is not built yet (docs/compile-policy.md):
# background: run a fallback graph now, compile the bucket in a background process;
# blocking: compile (or load) it first, on the request path; ahead: build every graph before
# the engine serves (vLLM's way). `compile_policy=None` reads COMPILE_POLICY_ENV, else per device:
# background on CPU; on CUDA blocking, as the compiler process would hold a second copy of the
# weights on the GPU after the KV cache was sized from what the first left free.
COMPILE_POLICY_CHOICES = ("background", "blocking", "ahead")
COMPILE_POLICY_ENV = "COMPILED_ENGINE_COMPILE_POLICY"
COMPILE_POLICY_DEFAULT = {"cpu": "background", "cuda": "blocking"}


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line; by default `--kebab-case` of its name, typed by
    its annotation, a bool defaulting to False is a switch and one defaulting to True is `--no-...`."""

    help: str  # what the flag does (for a `--no-...` switch: what turning the option off does)
    name: str | None = None  # the flag when it is not the field's name in kebab case
    choices: Collection[str] | Mapping[str, Any] | None = None  # a Mapping: flag text -> value
    parse: Callable[[str], Any] | None = None  # text -> value where the annotation's type cannot
    nargs: str | None = None


# The longest multi-step run (num_scheduler_steps): past a few dozen the host's share is gone, and
# a request that stops early would leave the rest of the run's work unused.
MAX_SCHEDULER_STEPS = 64


def option(default: Any, help: str, **flag: Any) -> Any:
    """A field with its default, its help, and `Flag`'s settings for the command line."""
    return field(default=default, metadata={"flag": Flag(help, **flag)})


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _speculative_json(text: str) -> SpeculativeConfig | None:
    try:
        return parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pooler_json(text: str) -> PoolerConfig | None:
    try:
        return parse_pooler_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# vLLM's `runner`: what the model is run for ("auto": pooling for a sentence-transformers folder).
RUNNER_CHOICES = ("auto", "generate", "pooling")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


# The server's tool-call parsers (entrypoints/openai/tool_parsers.py registers one under each name).
TOOL_CALL_PARSER_CHOICES = ("hermes",)
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """The engine's options as the user gave them (`LLM(...)`, the CLI), checked but unresolved.
    Keyword-only; the order is the CLI's help order. LLM's docstring says more about each."""

    enforce_eager: bool = option(False, "skip Inductor: run the lowered graph eagerly")
    model: str | None = option(None, "Hugging Face model folder (default: the embedded code model)")
    dtype: str = option(
        "auto", "weights' and activations' dtype (default auto: the checkpoint's)", choices=DTYPE_CHOICES
    )
    max_model_len: int | None = option(
        None, "longest sequence, prompt plus output (default: the model's max_position_embeddings)"
    )
    max_num_seqs: int = option(256, "most sequences in one step")
    max_num_batched_tokens: int | None = option(
        None, f"most tokens in one step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})"
    )
    long_prefill_token_threshold: int | None = option(
        None,
        "most prompt tokens one request prefills per step (0: up to the step budget); while any "
        "request decodes, also the most prompt tokens of the whole step, so a small value bounds "
        "how much new prompts lengthen the steps of requests already decoding (default: 0 "
        "in-process; under `compiled-engine serve`, 16 on CPU and 0 on CUDA)",
    )
    block_size: int = option(16, "tokens per KV cache block")
    num_kv_blocks: int | None = option(
        None, "KV cache blocks to allocate (default: sized from --kv-cache-memory or the device's memory)"
    )
    kv_cache_memory: int | None = option(
        None, "bytes for the KV cache (default: 1 GiB on CPU; on CUDA what the model and graphs leave)"
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage (default auto: the model's dtype); int8 or fp8 (e4m3; also fp8_e4m3) store "
        "codes with a float32 scale per token and KV head: about twice the blocks in the same memory",
        choices=KV_CACHE_DTYPE_CHOICES,
    )
    # Not `--seed`: `generate --seed` is the per-request sampling seed.
    seed: int = option(
        0, "seed of the engine-wide sampling stream unseeded requests share", name="--engine-seed"
    )
    device: str | None = option(None, "cpu or cuda (default: cuda if available)")  # or a torch.device
    compile_buckets: tuple[int, ...] | None = option(
        None,
        "comma-separated token-count buckets to compile (default: the engine's own list)",
        name="--buckets",
        parse=_int_list,
    )
    cache_dir: str | None = option(
        None, "compile cache (default: $COMPILED_ENGINE_CACHE_DIR, else ~/.cache/compiled_engine)"
    )
    compile_policy: str | None = option(
        None,
        "what a step does when its bucket's graph is not built yet: background (run a fallback "
        "graph, compile it in a background process), blocking (build it first), ahead (build "
        f"every graph before serving); default: ${COMPILE_POLICY_ENV}, else background on CPU, "
        "blocking on CUDA",
        choices=COMPILE_POLICY_CHOICES,
    )
    max_cpu_plan_tokens: int = option(
        16,
        "on CPU, decode steps of up to this many tokens replay their compiled graph's calls from a "
        "plan recorded in C++ (graphs/cpu_step_plan.py), not through Inductor's Python wrapper; "
        "each recorded bucket keeps its step's intermediates; 0: never",
    )
    fuse_linears: bool = option(True, "keep q/k/v and gate/up as separate GEMMs")
    quantization: str | None = option(
        None,
        "weight-only quantization of every linear (the LM head too, see --no-quantize-lm-head), at "
        "load: int8 (a scale per output feature) or int4 (a scale and zero point per group of input "
        "features); default: none, or the checkpoint's own compressed-tensors scheme "
        "(docs/quantization.md)",
        choices=QUANTIZATION_CHOICES,
    )
    # True by default: one-request decode streams the LM head every token, and llama.cpp's Q8_0 / Q4_0
    # quantize it too. A compressed-tensors checkpoint follows its own `ignore` list instead.
    quantize_lm_head: bool = option(
        True,
        "with --quantization, keep the LM head (output embedding) in the model dtype instead of "
        "quantizing it with the other linears",
        name="--no-quantize-lm-head",
    )
    quantization_group_size: int = option(
        32, "int4 quantization: input features per scale and zero point (32, 64, 128 or 256)"
    )
    enable_prefix_caching: bool = option(
        True,
        "compute every prompt in full (default: reuse cached KV blocks of shared prefixes)",
        name="--no-prefix-caching",
    )
    attention_backend: str = option(
        "auto",
        "paged-attention kernels (default auto: triton on CUDA when installed, else torch; "
        "on CPU the cpu kernel when a C++ compiler builds it, else torch)",
        choices=ATTENTION_BACKEND_CHOICES,
    )
    tensor_parallel_size: int = option(
        1, "shard the model over this many ranks (this process plus worker processes)"
    )
    pipeline_parallel_size: int = option(
        1,
        "split the decoder layers into this many stages, each on its own tensor-parallel ranks "
        "(pipeline_parallel_size x tensor_parallel_size processes in all; docs/distributed.md)",
    )
    data_parallel_size: int = option(
        1,
        "engine replicas behind one server, each a process of its own with its own KV cache, "
        "requests balanced by load (`compiled-engine serve` only)",
    )
    distributed_executor_backend: str = option(
        "mp",
        "where engines and their tensor-parallel / pipeline workers run: mp (processes on this "
        "machine) or ray (Ray actors: a served engine on any node of the cluster RAY_ADDRESS names, "
        "or of a local one; each pipeline stage's ranks on one node, stage 0's on rank 0's node; "
        "docs/distributed.md)",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    cpu_reserved_cores: int | None = option(
        None,
        "CPU cores a CPU engine's step threads leave to other work, such as the API server and its "
        "clients (default: 1 under `compiled-engine serve` on a machine with 2+ cores, as vLLM's CPU "
        "backend reserves one; 0 in-process, or when OMP_NUM_THREADS is set)",
    )
    async_scheduling: bool | None = option(
        None,
        "prepare the next step while the current one runs (auto: on for CUDA, off for CPU)",
        choices={"auto": None, "on": True, "off": False},
    )
    num_scheduler_steps: int = option(
        1,
        "decode steps one schedule runs back to back while every running request decodes with "
        "nothing but the sampler reading its logits (no penalties, bias, logprobs, grammar) and none "
        "waits (vLLM's multi-step scheduling): the host's work around a step is paid once "
        f"a run, and tokens stream in runs of up to this many; CPU, synchronous loop; 1 to "
        f"{MAX_SCHEDULER_STEPS} (docs/performance.md)",
    )
    # A dict as vLLM takes it (or its JSON text); kept as the checked record.
    speculative_config: SpeculativeConfig | None = option(
        None,
        "speculative decoding as JSON, vLLM's shape: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5, "disable_by_batch_size": 2}\' (docs/speculative_decoding.md)',
        parse=_speculative_json,
    )
    runner: str = option(
        "auto",
        "generate text, or pool hidden states into embeddings (auto: pooling when the model folder "
        "is a sentence-transformers one, with modules.json; docs/embeddings.md)",
        choices=RUNNER_CHOICES,
    )
    # A dict as vLLM takes it (or its JSON text); kept as the checked record.
    pooler_config: PoolerConfig | None = option(
        None,
        'pooling as JSON, vLLM\'s shape: \'{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true}\' '
        "(default: the folder's sentence-transformers files; docs/embeddings.md)",
        parse=_pooler_json,
    )

    def __post_init__(self) -> None:
        # Frozen and picklable as given: paths and devices as strings, lists as tuples.
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.device is not None and not isinstance(self.device, str):
            object.__setattr__(self, "device", str(self.device))  # a torch.device
        if self.compile_buckets is not None and not isinstance(self.compile_buckets, tuple):
            object.__setattr__(self, "compile_buckets", tuple(self.compile_buckets))
        object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        object.__setattr__(self, "pooler_config", parse_pooler_config(self.pooler_config))
        if self.runner not in RUNNER_CHOICES:
            raise ValueError(f"unknown runner {self.runner!r}: choose one of {', '.join(RUNNER_CHOICES)}")
        for name in (
            "max_num_seqs",
            "block_size",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
        ):
            _positive_int(name, getattr(self, name))
        reserved = self.cpu_reserved_cores
        bad_type = isinstance(reserved, bool) or not isinstance(reserved, int)
        if reserved is not None and (bad_type or reserved < 0):
            raise ValueError(f"cpu_reserved_cores must be an int >= 0 (or None: auto), got {reserved!r}")
        steps = self.num_scheduler_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_SCHEDULER_STEPS:
            raise ValueError(
                f"num_scheduler_steps must be an int from 1 to {MAX_SCHEDULER_STEPS}, got {steps!r}"
            )
        if steps > 1:
            for conflict, present in (
                ("async_scheduling=True", self.async_scheduling is True),
                ("speculative_config", self.speculative_config is not None),
                ("tensor or pipeline parallelism", self.world_size > 1),
            ):
                if present:
                    raise ValueError(
                        f"num_scheduler_steps={steps} cannot run with {conflict}: a multi-step run is "
                        "the synchronous loop's decode steps on one process"
                    )
        plan_tokens = self.max_cpu_plan_tokens
        if isinstance(plan_tokens, bool) or not isinstance(plan_tokens, int) or plan_tokens < 0:
            raise ValueError(f"max_cpu_plan_tokens must be an int >= 0, got {plan_tokens!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        threshold = self.long_prefill_token_threshold
        bad_threshold = isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0
        if threshold is not None and bad_threshold:
            raise ValueError(
                "long_prefill_token_threshold must be an int >= 0 (0: no limit; None: auto), "
                f"got {threshold!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not (self.async_scheduling is None or isinstance(self.async_scheduling, bool)):
            raise ValueError(f"async_scheduling must be None, True or False, got {self.async_scheduling!r}")
        for name in ("enforce_eager", "fuse_linears", "enable_prefix_caching", "quantize_lm_head"):
            _bool(name, getattr(self, name))
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(
                f"unknown attention_backend {self.attention_backend!r}: "
                f"choose one of {', '.join(ATTENTION_BACKEND_CHOICES)}"
            )
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}: "
                f"choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}"
            )
        if self.kv_cache_dtype != "auto" and self.attention_backend not in QUANTIZED_KV_BACKENDS:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} cannot run on attention_backend="
                f"{self.attention_backend!r}: a quantized KV cache is read by the "
                f"{', '.join(b for b in QUANTIZED_KV_BACKENDS if b != 'auto')} backends"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"unknown quantization {self.quantization!r}: choose one of "
                f"{', '.join(QUANTIZATION_CHOICES)} (or None for the checkpoint's weights as they are)"
            )
        self.weight_quantization()  # checks the group size
        if self.tensor_parallel_size > 1 and self.quantization is not None:
            raise ValueError(
                "quantization is not supported with tensor_parallel_size > 1 yet: the tensor-parallel "
                "pass shards float linears only"
            )
        if self.compile_policy is not None and self.compile_policy not in COMPILE_POLICY_CHOICES:
            raise ValueError(
                f"unknown compile_policy {self.compile_policy!r}: "
                f"choose one of {', '.join(COMPILE_POLICY_CHOICES)}"
            )
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"unknown distributed_executor_backend {self.distributed_executor_backend!r}: "
                f"choose one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}"
            )
        if self.tensor_parallel_size > 1 and self.compile_policy == "background":
            raise ValueError(
                "compile_policy='background' is not supported with tensor_parallel_size > 1: every rank "
                "must run each step on the same kind of graph; use 'blocking' or 'ahead'"
            )
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise ValueError(
                "async_scheduling=True is not supported with tensor_parallel_size > 1: every rank "
                "runs each step as rank 0 scheduled it (the synchronous loop)"
            )
        self._check_pipeline_parallel()

    def _check_pipeline_parallel(self) -> None:
        """What pipeline stages do not run yet (each untested there): refused by name."""
        if self.pipeline_parallel_size == 1:
            return
        refused = {
            "async_scheduling=True": self.async_scheduling is True,
            "compile_policy='background'": self.compile_policy == "background",
            "quantization": self.quantization is not None,
            "speculative_config with method 'draft_model'": self.speculative_config is not None
            and self.speculative_config.method == "draft_model",
            "data_parallel_size > 1": self.data_parallel_size > 1,
        }
        for what, asked in refused.items():
            if asked:
                raise ValueError(
                    f"{what} is not supported with pipeline_parallel_size > 1 yet: every stage runs each "
                    "step as rank 0 scheduled it, one step at a time (docs/distributed.md)"
                )

    # -- resolving ---------------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Processes one engine runs on: tensor_parallel_size ranks per pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def resolve_model_dir(self) -> str:
        """The model folder: `model`, else the small code model shipped inside the package."""
        if self.model is not None:
            return self.model
        from compiled_engine.default_model_path import default_model_dir

        return str(default_model_dir())

    def resolve_runner(self) -> str:
        """`runner`, with "auto" resolved: "pooling" for a sentence-transformers folder (modules.json)."""
        if self.runner != "auto":
            return self.runner
        # A sentence-transformers folder lists its modules in modules.json (pooling/'s reader).
        is_pooling = os.path.isfile(os.path.join(self.resolve_model_dir(), "modules.json"))
        return "pooling" if is_pooling else "generate"

    def resolve_device(self) -> torch.device:
        """`device`, else CUDA when available, else the CPU (a rank's CUDA index is set later)."""
        import torch

        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def weight_quantization(self) -> WeightQuantization | None:
        """`quantization` and its group size as a record (None: unquantized); ValueError when invalid."""
        from compiled_engine.records.weight_quantization import WeightQuantization

        if self.quantization is None:
            return None
        if isinstance(self.quantization_group_size, bool) or not isinstance(
            self.quantization_group_size, int
        ):
            raise ValueError(f"quantization_group_size must be an int, got {self.quantization_group_size!r}")
        group_size = self.quantization_group_size if self.quantization == "int4" else None
        return WeightQuantization(self.quantization, group_size, lm_head=self.quantize_lm_head)

    def create_engine_config(self, device: torch.device, model_config: ModelConfig) -> EngineConfig:
        """Every option resolved against the device and the loaded model's config. The KV block
        count is not among them: it is sized later, from what the runner leaves (LLMEngine)."""
        from compiled_engine.config import EngineConfig
        from compiled_engine.graphs.buckets import check_buckets, default_buckets

        limit = model_config.max_position_embeddings
        max_model_len = limit if self.max_model_len is None else self.max_model_len
        if max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        if self.enforce_eager:
            buckets: tuple[int, ...] = ()  # nothing is compiled
        elif self.compile_buckets is not None:
            buckets = check_buckets(self.compile_buckets, max_num_batched_tokens)
        else:
            buckets = default_buckets(max_num_batched_tokens, self.max_num_seqs)
        if self.num_scheduler_steps > 1 and device.type != "cpu":
            raise ValueError(
                f"num_scheduler_steps={self.num_scheduler_steps} runs on the CPU only: on {device.type} "
                "the async loop already hides the host's work behind the device's"
            )
        if self.world_size > 1:
            async_scheduling = False  # every rank runs each step as rank 0 scheduled it
        elif self.async_scheduling is None:
            async_scheduling = ASYNC_SCHEDULING_DEFAULT.get(device.type, False)
        else:
            async_scheduling = self.async_scheduling
        return EngineConfig(
            model_dir=self.resolve_model_dir(),
            compile_policy=self._resolve_compile_policy(device),
            dtype=model_config.dtype,
            device=device,
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=self.block_size,
            num_kv_blocks_override=self.num_kv_blocks,
            kv_cache_memory=self.kv_cache_memory,
            kv_cache_dtype="fp8" if self.kv_cache_dtype == "fp8_e4m3" else self.kv_cache_dtype,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            compile_buckets=buckets,
            max_cpu_plan_tokens=self.max_cpu_plan_tokens,
            fuse_linears=self.fuse_linears,
            cache_dir=self.cache_dir,
            async_scheduling=async_scheduling,
            num_scheduler_steps=self.num_scheduler_steps,
            attention_backend=self.attention_backend,
            enable_prefix_caching=self.enable_prefix_caching,
            long_prefill_token_threshold=self.long_prefill_token_threshold or 0,
            tensor_parallel_size=self.tensor_parallel_size,
            # Tensor- and pipeline-parallel ranks size their own threads (engine/llm_engine.py).
            cpu_reserved_cores=(self.cpu_reserved_cores or 0) if self.world_size == 1 else 0,
            speculative=self.speculative_config,
            quantization=self._resolve_quantization(device, model_config),
        )

    def _resolve_quantization(
        self, device: torch.device, model_config: ModelConfig
    ) -> WeightQuantization | None:
        """The scheme asked for, or the checkpoint's own; refused where its kernels cannot run."""
        from compiled_engine.kernels.weight_quantization import check_quantization_runs

        asked = self.weight_quantization()
        checkpoint = model_config.quantization
        if checkpoint is not None and asked is not None and asked != checkpoint:
            raise ValueError(
                f"the checkpoint is already quantized ({checkpoint.label}, from {checkpoint.source}); "
                f"quantization={self.quantization!r} cannot re-quantize it: leave quantization unset"
            )
        quantization = checkpoint if checkpoint is not None else asked
        if quantization is not None:
            check_quantization_runs(quantization, model_config.dtype, device)
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    f"a {quantization.label} quantized model cannot run with tensor_parallel_size > 1 yet: "
                    "the tensor-parallel pass shards float linears only"
                )
        return quantization

    def _resolve_compile_policy(self, device: torch.device) -> str:
        policy = self.compile_policy
        if policy is None:
            policy = os.environ.get(COMPILE_POLICY_ENV, "").strip() or None
            if policy is not None and policy not in COMPILE_POLICY_CHOICES:
                raise ValueError(
                    f"{COMPILE_POLICY_ENV}={policy!r} is not a compile policy: choose one of "
                    f"{', '.join(COMPILE_POLICY_CHOICES)}"
                )
        if policy is None:
            policy = COMPILE_POLICY_DEFAULT.get(device.type, "blocking")
        if policy == "background" and self.world_size > 1:
            policy = "blocking"  # the environment's default: the explicit option is refused above
        if policy == "background" and device.type != "cpu":
            raise ValueError(
                f"compile_policy='background' runs on the CPU only for now, not on {device.type}: the "
                "compiler process would hold a second copy of the weights on the device after the KV "
                "cache was sized from its free memory; use 'blocking' or 'ahead' (or "
                "`compiled-engine warmup` ahead of time)"
            )
        return policy

    # -- the command line --------------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, skip: Collection[str] = ()) -> None:
        """One flag per field (but those named in `skip`); the parsed value lands under the field's name."""
        hints = typing.get_type_hints(cls)
        # A subclass's own options first (serve: the server's, then the engine's).
        engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
        for f in sorted(dataclasses.fields(cls), key=lambda f: f.name in engine_fields):
            if f.name not in skip:
                _add_flag(parser, f, hints[f.name])

    @classmethod
    def from_cli_args(cls: type[_Args], namespace: argparse.Namespace) -> _Args:
        """The dataclass from parsed flags (fields without a flag in that parser keep their default)."""
        values: dict[str, Any] = {}  # argparse's values, each converted by its field's flag
        for f in dataclasses.fields(cls):
            if hasattr(namespace, f.name):
                value = getattr(namespace, f.name)
                choices = f.metadata["flag"].choices
                if isinstance(choices, Mapping):
                    value = choices[value]
                values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class ServerArgs(EngineArgs):
    """`compiled-engine serve`: the engine's options plus the HTTP server's."""

    host: str = option("127.0.0.1", "address to bind (default: 127.0.0.1, local only)")
    port: int = option(8000, "port to listen on (0: any free one)")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    served_model_name: tuple[str, ...] | None = option(
        None, "name(s) clients pass as `model` (default: the --model argument, or 'default')", nargs="+"
    )
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES,
        f"largest request body accepted; larger ones get 413 (default: {DEFAULT_MAX_REQUEST_BYTES})",
    )
    tool_call_parser: str = option(
        "hermes",
        "how tool calls are read out of replies to tool_choice 'auto' (default: hermes, "
        "<tool_call>{...}</tool_call>)",
        choices=TOOL_CALL_PARSER_CHOICES,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.served_model_name, str):
            object.__setattr__(self, "served_model_name", (self.served_model_name,))
        elif self.served_model_name is not None:
            object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
            if not self.served_model_name:
                raise ValueError("served_model_name must name at least one model")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int from 0 to 65535, got {self.port!r}")
        _positive_int("max_request_bytes", self.max_request_bytes)
        if self.tool_call_parser not in TOOL_CALL_PARSER_CHOICES:
            raise ValueError(
                f"tool_call_parser must be one of {list(TOOL_CALL_PARSER_CHOICES)}, "
                f"got {self.tool_call_parser!r}"
            )

    def engine_args(self) -> EngineArgs:
        """The engine's part alone (what the engine and its workers receive; no API key)."""
        return EngineArgs(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineArgs)})

    def served_model_names(self) -> tuple[str, ...]:
        return self.served_model_name or (self.model or "default",)


def _add_flag(parser: argparse.ArgumentParser, f: dataclasses.Field, hint: Any) -> None:
    flag: Flag = f.metadata["flag"]
    if hint is bool:
        # A switch that turns the default around: `--x` for a False default, `--no-x` for True.
        name = flag.name or ("--no-" if f.default else "--") + f.name.replace("_", "-")
        action = "store_false" if f.default else "store_true"
        parser.add_argument(name, dest=f.name, action=action, help=flag.help)
        return
    name = flag.name or "--" + f.name.replace("_", "-")
    if isinstance(flag.choices, Mapping):
        default = next(text for text, value in flag.choices.items() if value == f.default)
        parser.add_argument(name, dest=f.name, choices=list(flag.choices), default=default, help=flag.help)
        return
    parser.add_argument(
        name,
        dest=f.name,
        type=flag.parse or _scalar_type(hint),
        choices=None if flag.choices is None else list(flag.choices),
        nargs=flag.nargs,
        default=f.default,
        help=flag.help,
        # Named after the flag, not the field (`--buckets BUCKETS`), as argparse would by itself.
        metavar=None if flag.choices is not None else name.removeprefix("--").replace("-", "_").upper(),
    )


def _scalar_type(hint: Any) -> type:
    """What argparse converts one word to: `int | None` -> int, `tuple[str, ...]` -> str."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) is tuple:
        hint = typing.get_args(hint)[0]
    if hint not in (int, str, float):
        raise TypeError(f"no command-line form for {hint!r}: give the field's option() a parse=")
    return hint
