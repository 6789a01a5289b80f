"""Building the draft model of speculative decoding's `draft_model` method.

The draft is loaded like the target (model_loader/), checked against it — the same vocabulary and
tokenizer, room for `max_model_len` — and run one of two ways:

- a Llama-family draft (worker/draft_decoder.py `supports`): by its own tight loop, k proposals
  per request from one compiled call over a small contiguous KV buffer of its own
  (worker/draft_loop_proposer.py). A draft's step through a `ModelRunner` costs nearly a
  target step when the target is small, which is where drafts are used on a CPU.
- any other: by a second `ModelRunner` built from the target's resolved options with the draft's
  folder (worker/draft_proposer.py), its KV cache in the target's block ids.

Weight quantization stays the target's alone; the async loop is the target's (the draft runs
while the scheduler plans a step).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from compiled_engine.config import EngineConfig
from compiled_engine.engine.kv_cache_sizing import KVCacheLayout
from compiled_engine.kernels.cpu_draft_decoder import CPU_DRAFT_DECODER_VERSION
from compiled_engine.model_loader.loader import LoadedModel, load_model
from compiled_engine.records.draft_proposer import DraftProposer, DraftSampling
from compiled_engine.speculative_config import SpeculativeConfig
from compiled_engine.worker.draft_decoder import DraftDecoder, supports
from compiled_engine.worker.draft_loop_proposer import DraftLoopProposer
from compiled_engine.worker.draft_proposer import DraftModelProposer
from compiled_engine.worker.model_runner import ModelRunner

# The draft's own KV buffer has a row per request that speculates: at most this many (more
# requests than this speculating at once take turns, least recently used first).
MAX_DRAFT_SLOTS = 64

logger = logging.getLogger(__name__)


class DraftModelError(ValueError):
    """A draft model that cannot propose for this target (named in the message)."""


def build_draft_proposer(
    spec: SpeculativeConfig, target: LoadedModel, config: EngineConfig, num_kv_blocks: int
) -> DraftModelProposer | DraftLoopProposer:
    """Load the draft in `spec.model`, check it against `target`, build and warm its proposer."""
    assert spec.method == "draft_model" and spec.model is not None
    if config.tensor_parallel_size > 1:
        raise DraftModelError("speculative_config: method 'draft_model' does not run with tensor parallelism")
    # In the target's dtype, so the two runners stage the same kind of buffers.
    dtype = str(config.dtype).removeprefix("torch.")
    draft = load_model(spec.model, dtype=dtype, device=config.device)
    check_draft_matches(draft, target, spec.model, config.max_model_len)
    k = spec.num_speculative_tokens
    # Positions up to max_model_len - 1, and the k - 1 proposals fed after the last of them.
    max_len = config.max_model_len + k
    if supports(draft.model, max_len):
        limit = spec.disable_by_batch_size or config.max_num_seqs
        num_slots = max(1, min(config.max_num_seqs, limit, MAX_DRAFT_SLOTS))
        decoder = DraftDecoder(
            draft.model, num_slots, max_len, k, config.device, compiled=not config.enforce_eager
        )
        proposer = DraftLoopProposer(decoder, num_slots, config.max_num_batched_tokens, config.seed)
        _warm_up(proposer)
        how = (
            f"the C++ loop (kernels/cpu_draft_decoder.cpp, version {CPU_DRAFT_DECODER_VERSION[:8]})"
            if decoder.native is not None
            else "a compiled torch call"
            if not config.enforce_eager
            else "eager torch"
        )
        logger.info("draft model %s: k=%d proposals a call by %s", spec.model, k, how)
        return proposer
    return _runner_proposer(draft, spec.model, config, num_kv_blocks)


def _warm_up(proposer: DraftProposer) -> None:
    """Build the proposal call now (a compiled one: a greedy and a sampled call share its graph;
    the C++ one: its library), not on the first request; then forget the warm-up request."""
    for temperature in (0.0, 1.0):
        proposer.propose("warm-up", np.array([0, 0], dtype=np.int64), (), 1, DraftSampling(temperature))
    proposer.forget(("warm-up",))


def _runner_proposer(
    draft: LoadedModel, draft_dir: str, config: EngineConfig, num_kv_blocks: int
) -> DraftModelProposer:
    draft_config = dataclasses.replace(
        config,
        model_dir=draft_dir,
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
