"""`PoolingEngine`: an embedding model loaded, captured and run on packed prefill-only steps.

Built by `LLM(runner="pooling")` (or a sentence-transformers folder with runner "auto"). It
loads the model's body (model_loader with `body_only`), resolves the pooling from the
`pooler_config` option over the folder's sentence-transformers files, and answers `embed()`:
tokenize, check each input's length, pack the inputs into steps under the token budget
(step_packing.py), run each step (body_runner.py), pool and finish each embedding (pooler.py).
There is no scheduler: pooling requests are one prefill each, with nothing to keep between steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from compiled_engine.engine_args import EngineArgs
from compiled_engine.errors import ModelLoadError
from compiled_engine.kernels.backends import resolve_attention_backend
from compiled_engine.model_loader.loader import load_model
from compiled_engine.pooler_config import PoolerConfig, PoolingSpec
from compiled_engine.pooling.body_runner import BodyRunner, is_bidirectional
from compiled_engine.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput
from compiled_engine.pooling.pooler import finish_embedding
from compiled_engine.pooling.sentence_transformers_folder import (
    SentenceTransformersPipeline,
    read_pipeline,
)
from compiled_engine.pooling.step_packing import pack_steps
from compiled_engine.pooling_params import PoolingParams

# The pooling a body gets when neither the folder nor the options say: decoder-only embedders
# read the last token (the only one that saw the whole input), encoders their first (CLS).
DEFAULT_POOLING_TYPE = {False: "LAST", True: "CLS"}

EmbedPrompt = str | dict[str, Any] | Sequence[int]


def resolve_pooling_spec(
    options: PoolerConfig | None,
    pipeline: SentenceTransformersPipeline | None,
    hidden_size: int,
    bidirectional: bool,
) -> PoolingSpec:
    """The option's fields first, then the folder's files, then the defaults."""
    pooling_type = (options.pooling_type if options else None) or (
        pipeline.pooling_type if pipeline else None
    )
    normalize = options.normalize if options and options.normalize is not None else None
    if normalize is None:
        # A sentence-transformers folder says by the presence of its Normalize module.
        normalize = pipeline.normalize if pipeline is not None else True
    return PoolingSpec(pooling_type or DEFAULT_POOLING_TYPE[bidirectional], normalize, hidden_size)


class PoolingEngine:
    def __init__(self, args: EngineArgs) -> None:
        for name, unsupported in (
            ("tensor_parallel_size", args.tensor_parallel_size != 1),
            ("speculative_config", args.speculative_config is not None),
            ("quantization", args.quantization is not None),
            ("kv_cache_dtype", args.kv_cache_dtype != "auto"),
        ):
            if unsupported:
                raise ValueError(f"{name} is not supported with runner='pooling'")
        self.model_dir = model_dir = args.resolve_model_dir()
        pipeline = read_pipeline(model_dir)
        if pipeline is None and args.pooler_config is None:
            raise ModelLoadError(
                f"{model_dir} is not a pooling model: it has no sentence-transformers modules.json; "
                "give pooler_config={'pooling_type': 'LAST' | 'MEAN' | 'CLS'} to pool its body anyway"
            )
        self.device = device = args.resolve_device()
        loaded = load_model(model_dir, args.dtype, device, body_only=True)
        if loaded.tokenizer is None:
            raise ModelLoadError(f"{model_dir} has no tokenizer files; an embedding model needs one")
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.model_config
        self.config = args.create_engine_config(device, loaded.model_config)
        limit = self.config.max_model_len
        if pipeline is not None and pipeline.max_seq_length is not None:
            limit = min(limit, pipeline.max_seq_length)
        self.max_model_len = limit
        bidirectional = is_bidirectional(loaded.model)
        self.spec = resolve_pooling_spec(
            args.pooler_config, pipeline, loaded.model_config.hidden_size, bidirectional
        )
        backend = self.config.attention_backend
        if bidirectional:
            # Only the torch op attends bidirectionally (kernels/paged_attention.py).
            if backend not in ("auto", "torch"):
                raise ValueError(
                    f"attention_backend={backend!r} attends causally only; the encoder body of "
                    f"{model_dir} runs on attention_backend='torch' (or 'auto')"
                )
            backend = "torch"
        # A pooling input is never split across steps: a step must hold the longest one.
        self.token_budget = max(self.config.max_num_batched_tokens, limit)
        self.runner = BodyRunner(
            loaded.model,
            loaded.model_config,
            pooling_type=self.spec.pooling_type,
            token_budget=self.token_budget,
            max_num_seqs=self.config.max_num_seqs,
            block_size=self.config.block_size,
            device=device,
            attention_backend=resolve_attention_backend(backend, device),
            compiled=not self.config.enforce_eager,
        )
        self._request_ids = itertools.count()

    def close(self) -> None:
        pass

    # -- requests ------------------------------------------------------------------------------------

    def check_params(self, params: PoolingParams) -> None:
        if params.dimensions is not None and params.dimensions > self.spec.hidden_size:
            raise ValueError(
                f"dimensions={params.dimensions} is more than the model gives: its embeddings have "
                f"{self.spec.hidden_size} values"
            )

    def tokenize(self, prompt: EmbedPrompt, params: PoolingParams) -> list[int]:
        """The prompt's token ids, truncated only when `truncate_prompt_tokens` asks."""
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str):
            # An empty text would embed only the special tokens the tokenizer adds: refused.
            ids = list(self.tokenizer(text)["input_ids"]) if text else []
        else:
            raw = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
            if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
                raise ValueError(
                    "a prompt must be a string, a list of token ids, {'prompt': str} or "
                    f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
                )
            ids = list(raw)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token id {bad[0]!r} is not in the model's vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("the input is empty: an embedding needs at least one token")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if keep > self.max_model_len:
                raise ValueError(
                    f"truncate_prompt_tokens={keep} is more than the model's {self.max_model_len} tokens"
                )
            ids = ids[-keep:]  # vLLM's side: the last tokens are kept
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the input has {len(ids)} tokens, more than the model's {self.max_model_len}; "
                "set truncate_prompt_tokens to embed its last tokens"
            )
        return ids

    def embed(
        self,
        prompts: Sequence[EmbedPrompt],
        params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Every prompt's embedding, in input order; every input is checked before any step runs."""
        return self.run(self.prepare(prompts, params))

    def prepare(
        self,
        prompts: Sequence[EmbedPrompt],
        params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[tuple[list[int], PoolingParams]]:
        """Each prompt's checked token ids and params; ValueError naming the first problem."""
        if not prompts:
            raise ValueError("no input: give at least one prompt")
        if params is None:
            params = PoolingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, PoolingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} pooling params for {len(prompts)} prompts")
        for p in per_prompt:
            if not isinstance(p, PoolingParams):
                raise TypeError(f"pooling_params must be PoolingParams, got {type(p).__name__}")
            self.check_params(p)
        return [(self.tokenize(prompt, p), p) for prompt, p in zip(prompts, per_prompt, strict=True)]

    def run(self, prepared: Sequence[tuple[list[int], PoolingParams]]) -> list[EmbeddingRequestOutput]:
        """The embeddings of prepared inputs (`prepare`), packed into as few steps as fit."""
        token_lists = [tokens for tokens, _ in prepared]
        per_prompt = [p for _, p in prepared]
        pooled: list[torch.Tensor | None] = [None] * len(token_lists)
        for step in pack_steps([len(t) for t in token_lists], self.token_budget, self.config.max_num_seqs):
            vectors = self.runner.run([token_lists[i] for i in step]).cpu()
            for row, index in enumerate(step):
                pooled[index] = vectors[row]
        outputs = []
        for tokens, vector, p in zip(token_lists, pooled, per_prompt, strict=True):
            assert vector is not None
            outputs.append(
                EmbeddingRequestOutput(
                    request_id=str(next(self._request_ids)),
                    outputs=EmbeddingOutput(finish_embedding(vector, self.spec, p)),
                    prompt_token_ids=tokens,
                )
            )
        return outputs
