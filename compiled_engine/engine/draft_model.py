"""Building the draft model of speculative decoding's `draft_model` method.

The draft is loaded like the target (model_loader/), checked against it — the same vocabulary and
tokenizer, room for `max_model_len` — and run by a second `ModelRunner` built from the target's
resolved options with the draft's folder: the same compile route (buckets, compile cache, CUDA
graphs), its own KV cache with as many blocks as the target's (worker/draft_proposer.py says
why). Weight quantization stays the target's alone; the async loop is the target's (the draft
runs its steps to completion while the scheduler plans a step).
"""

from __future__ import annotations

import dataclasses

from compiled_engine.config import EngineConfig
from compiled_engine.engine.kv_cache_sizing import KVCacheLayout
from compiled_engine.model_loader.loader import LoadedModel, load_model
from compiled_engine.speculative_config import SpeculativeConfig
from compiled_engine.worker.draft_proposer import DraftModelProposer
from compiled_engine.worker.model_runner import ModelRunner


class DraftModelError(ValueError):
    """A draft model that cannot propose for this target (named in the message)."""


def build_draft_proposer(
    spec: SpeculativeConfig, target: LoadedModel, config: EngineConfig, num_kv_blocks: int
) -> DraftModelProposer:
    """Load the draft in `spec.model`, check it against `target`, build and warm its runner."""
    assert spec.method == "draft_model" and spec.model is not None
    if config.tensor_parallel_size > 1:
        raise DraftModelError("speculative_config: method 'draft_model' does not run with tensor parallelism")
    # In the target's dtype, so the two runners stage the same kind of buffers.
    dtype = str(config.dtype).removeprefix("torch.")
    draft = load_model(spec.model, dtype=dtype, device=config.device)
    check_draft_matches(draft, target, spec.model, config.max_model_len)
    draft_config = dataclasses.replace(
        config,
        model_dir=spec.model,
        dtype=draft.model_config.dtype,
        async_scheduling=False,
        speculative=None,
        quantization=None,
        num_kv_blocks_override=num_kv_blocks,
    )
    caches = KVCacheLayout.of(draft, draft_config).allocate(num_kv_blocks)
    runner = ModelRunner(draft.model, caches, draft_config)
    runner.warm_up()
    if runner.supports_graphs:
        runner.capture_graphs()
    return DraftModelProposer(runner, config.max_num_batched_tokens)


def check_draft_matches(draft: LoadedModel, target: LoadedModel, draft_dir: str, max_model_len: int) -> None:
    """The draft proposes token ids the target verifies: both must mean the same thing by them."""
    draft_vocab, target_vocab = draft.model_config.vocab_size, target.model_config.vocab_size
    if draft_vocab != target_vocab:
        raise DraftModelError(
            f"speculative_config: the draft model in {draft_dir} has a vocabulary of {draft_vocab} "
            f"tokens, the target's has {target_vocab}: a draft must share the target's tokenizer"
        )
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab() or _specials(draft) != _specials(
            target
        ):
            raise DraftModelError(
                f"speculative_config: the draft model in {draft_dir} has a different tokenizer from "
                "the target's (its token ids mean other text): a draft must share the target's tokenizer"
            )
    limit = draft.model_config.max_position_embeddings
    if limit < max_model_len:
        raise DraftModelError(
            f"speculative_config: the draft model in {draft_dir} takes at most {limit} positions "
            f"(max_position_embeddings), less than max_model_len={max_model_len}"
        )


def _specials(loaded: LoadedModel) -> dict[str, object]:
    tokenizer = loaded.tokenizer
    assert tokenizer is not None
    return dict(tokenizer.special_tokens_map)
