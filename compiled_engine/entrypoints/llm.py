"""`LLM`: the offline batch API (mirrors vLLM's `LLM` class)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch
from tqdm.auto import tqdm

from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.stats import EngineStats
from compiled_engine.engine_args import EngineArgs
from compiled_engine.outputs import RequestOutput
from compiled_engine.pooling.outputs import EmbeddingRequestOutput
from compiled_engine.pooling.pooling_engine import EmbedPrompt, PoolingEngine
from compiled_engine.pooling_params import PoolingParams
from compiled_engine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        seed: int = 0,
        device: str | torch.device | None = None,
        enforce_eager: bool = False,
        compile_buckets: Sequence[int] | None = None,
        fuse_linears: bool = True,
        cache_dir: str | None = None,
        async_scheduling: bool | None = None,
        attention_backend: str = "auto",
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        **engine_args: Any,
    ) -> None:
        """Every argument is an `EngineArgs` field (compiled_engine/engine_args.py, where each is
        described; the common ones are named here, as in vLLM, any other goes through `engine_args`;
        an unknown name raises TypeError). No `model`: the small code model shipped in the package.

        `enforce_eager=True` runs the lowered graphs without Inductor (fast start, slower steps);
        `compile_buckets` overrides the token-count buckets compiled otherwise
        (graphs/buckets.py `default_buckets`); `fuse_linears` makes the compiled graphs run q/k/v
        and gate/up as one GEMM each (graphs/passes/fuse_linears.py; ignored when eager);
        `cache_dir` is the on-disk compile cache (default: COMPILED_ENGINE_CACHE_DIR, else
        ~/.cache/compiled_engine; graphs/compile_cache.py): a start whose options match an
        earlier one loads its compiled graphs instead of tracing and compiling again (all of
        them before `LLM()` returns); `compile_policy` says what a step does when its graph is not
        built yet: "background" (the CPU default: run a ready fallback graph and compile the
        missing ones in a background process, swapped in between steps), "blocking" (the CUDA
        default: build it first, on the request path) or "ahead" (build every graph before
        `LLM()` returns); docs/compile-policy.md;
        `async_scheduling` overlaps the host's scheduling and input preparation for the next step
        with the current one (None: the best default for the device — on for CUDA, off for CPU);
        `attention_backend` picks the paged-attention kernels: "auto" (CUDA: triton when installed,
        else torch; CPU: cpu when its C++ kernel builds, else torch), "torch", "cpu", "triton" (on
        CPU only under TRITON_INTERPRET=1, for tests) or "flashinfer" (kernels/backends.py);
        `kv_cache_dtype` (an `engine_args` keyword) stores the KV cache as "int8" or "fp8" (e4m3;
        vLLM's "fp8_e4m3" too) codes with a float32 scale per token and KV head: about twice the
        blocks in the same memory, less KV read per decode step (docs/kv_cache_quantization.md);
        `enable_prefix_caching` keeps computed KV blocks and lets later requests whose tokens
        start the same way (a shared system prompt, the n samples of one prompt, a recompute
        after preemption) reuse them instead of computing them again (core/kv_cache_manager.py;
        `stats()` reports the hit rate); `tensor_parallel_size` shards the model over that many
        ranks, this process and N-1 worker processes it starts (compiled_engine/distributed/;
        `close()` or collecting the LLM stops them); `speculative_config={"method": "ngram",
        "num_speculative_tokens": k, ...}` verifies up to k prompt-lookup proposals per request and
        step (docs/speculative_decoding.md; `stats()` reports the acceptance);
        `quantization="int8" | "int4"` (with
        `quantization_group_size` for int4) stores every linear but the LM head in fewer bits, done at
        load by a graph pass; a compressed-tensors checkpoint brings its own (docs/quantization.md)."""
        unknown = sorted(set(engine_args) - {f.name for f in dataclasses.fields(EngineArgs)})
        if unknown:
            raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
        args = EngineArgs(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            seed=seed,
            device=None if device is None else str(device),  # EngineArgs keeps devices as strings
            enforce_eager=enforce_eager,
            compile_buckets=None if compile_buckets is None else tuple(compile_buckets),
            fuse_linears=fuse_linears,
            cache_dir=cache_dir,
            async_scheduling=async_scheduling,
            attention_backend=attention_backend,
            enable_prefix_caching=enable_prefix_caching,
            tensor_parallel_size=tensor_parallel_size,
            **engine_args,
        )
        self.engine: LLMEngine | PoolingEngine
        if args.resolve_runner() == "pooling":
            # An embedding model: no scheduler, no KV blocks (compiled_engine/pooling/).
            self.engine = PoolingEngine(args)
        else:
            self.engine = LLMEngine(args)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """An LLM built from an `EngineArgs` (e.g. the CLI's); the engine's fields of a subclass."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)})

    def close(self) -> None:
        """Stop the background graph compiler and the tensor-parallel worker processes now, if any."""
        self.engine.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.generation_engine("stats").stats()

    def generation_engine(self, method: str) -> LLMEngine:
        """The generation engine; `method` names the caller in the error a pooling model gets."""
        if isinstance(self.engine, PoolingEngine):
            raise ValueError(
                f"LLM.{method}() needs a generation model; this one is a pooling model (use embed())"
            )
        return self.engine

    def embed(
        self,
        prompts: EmbedPrompt | Sequence[EmbedPrompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string, token ids, {"prompt": ...} or {"prompt_token_ids": ...}),
        in input order; `truncate_prompt_tokens` as in `PoolingParams` (docs/embeddings.md)."""
        if not isinstance(self.engine, PoolingEngine):
            raise ValueError(
                "LLM.embed() needs a pooling model: load a sentence-transformers folder, or pass "
                "runner='pooling' (with pooler_config for a plain model folder)"
            )
        batch: list[EmbedPrompt]
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(EmbedPrompt, prompts)]  # one prompt (a text or its token ids)
        else:
            batch = list(cast(Sequence[EmbedPrompt], prompts))
        if truncate_prompt_tokens is not None:
            base = pooling_params if isinstance(pooling_params, PoolingParams) else PoolingParams()
            if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
                raise ValueError("truncate_prompt_tokens with a list of pooling_params: set it in each")
            pooling_params = dataclasses.replace(base, truncate_prompt_tokens=truncate_prompt_tokens)
        return self.engine.embed(batch, pooling_params)

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns the finished outputs in input order."""
        engine = self.generation_engine("generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        # Everything is validated before the first request is queued: one bad prompt
        # rejects the call and leaves the engine exactly as it was.
        validated = engine.validate(prompts, sampling_params)
        ids = []
        # Only the final outputs are returned, so the engine reports nothing else (vLLM does the same).
        final_only: dict[int, SamplingParams] = {}
        try:
            for processed, params in validated:
                if params.output_kind is not RequestOutputKind.FINAL_ONLY:
                    if id(params) not in final_only:
                        final_only[id(params)] = dataclasses.replace(
                            params, output_kind=RequestOutputKind.FINAL_ONLY
                        )
                    params = final_only[id(params)]
                rid = engine.next_request_id()
                engine.add_request(rid, processed, params)
                ids.append(rid)
            finals = self._run_to_completion(engine, len(ids), use_tqdm)
        except BaseException:
            engine.abort_request(ids)
            # Steps still in flight hold the aborted requests' blocks. A failure here is a
            # consequence of the one being raised, which is the one to report.
            with contextlib.suppress(Exception):
                engine.drain()
            raise
        return [finals[rid] for rid in ids]

    def _run_to_completion(self, engine: LLMEngine, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm or total < 2)
        with bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        bar.update(1)
        return finals
