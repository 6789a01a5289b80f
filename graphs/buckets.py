"""Token-count buckets: which static shape a step runs at, and how it is padded to it.

A compiled graph per bucket is specialised to static T (tokens), S (sequences) and K (logits
rows); a step with n tokens runs in the smallest bucket >= n, padded. Steps above the largest
bucket run the one dynamic-shape graph.

Padding rule (the paged-attention op's contract, kernels/reference.py):
- tokens n..T-1: input id 0, position 0, slot_mapping -1. The op writes -1 slots into the
  cache's scratch block (kernels/paged_attention.py), and rows past query_start_loc[-1] belong
  to no sequence, so they attend to nothing and return zeros: padded rows never touch a real
  cache block.
- sequences s..S-1: seq_len 0, no query tokens (query_start_loc stays at n), block-table row 0.
- logits rows k..K-1: index row 0; the caller keeps only the first k rows.
S = K = min(bucket, max_num_seqs): a step cannot have more sequences than tokens or than the
engine admits, so every real step fits.

Block-table width stays dynamic inside each bucket's graph (one symbol; nothing else in the
graph depends on it): the reference op gathers width * block_size keys per query token, so
padding every step to the engine's widest table (128 blocks for a 2048-token model) would
make a short decode gather 16x the keys it needs, and bucketing the width too would multiply
the compiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from compiled_engine.graphs.step_inputs import FrontViews, StepInputs, front_of

# Small buckets are where decode lives (one token per sequence); above 128, every 128.
SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
LARGE_BUCKET_STEP = 128
# Steps above this many tokens are prefill-heavy: the dynamic graph's overhead is negligible there,
# and each extra bucket costs a cold Inductor compile at start-up.
DEFAULT_MAX_BUCKET = 512


@dataclass(frozen=True)
class BucketShape:
    """The static shape a bucket's graph is compiled for."""

    num_tokens: int  # T
    num_seqs: int  # S, and K (logits rows)


def default_buckets(
    max_num_batched_tokens: int, max_num_seqs: int, max_bucket: int = DEFAULT_MAX_BUCKET
) -> tuple[int, ...]:
    """Ascending token counts to compile, none above the step budget or `max_bucket`.

    The budget itself (when <= max_bucket) and a full batch of decodes (max_num_seqs tokens)
    are buckets too, so those common steps run unpadded.
    """
    for name, value in (
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("max_num_seqs", max_num_seqs),
        ("max_bucket", max_bucket),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    cap = min(max_num_batched_tokens, max_bucket)
    sizes = set(SMALL_BUCKETS)
    sizes.update(range(SMALL_BUCKETS[-1] + LARGE_BUCKET_STEP, cap + 1, LARGE_BUCKET_STEP))
    sizes.add(cap)
    sizes.add(min(max_num_seqs, cap))
    return tuple(sorted(b for b in sizes if b <= cap))


def check_buckets(buckets: Sequence[int], max_num_batched_tokens: int) -> tuple[int, ...]:
    """Validate a configured bucket list; returns it sorted."""
    if not buckets:
        raise ValueError("buckets must name at least one token count")
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"buckets must be positive ints, got {b!r}")
        if b > max_num_batched_tokens:
            raise ValueError(f"bucket {b} exceeds max_num_batched_tokens={max_num_batched_tokens}")
    if len(set(buckets)) != len(buckets):
        raise ValueError(f"buckets contain duplicates: {sorted(buckets)}")
    return tuple(sorted(buckets))


def bucket_for(num_tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= num_tokens (buckets ascending); None above the largest."""
    for b in buckets:
        if b >= num_tokens:
            return b
    return None


def bucket_shape(bucket: int, max_num_seqs: int) -> BucketShape:
    return BucketShape(num_tokens=bucket, num_seqs=min(bucket, max_num_seqs))


def eager_shape(
    num_tokens: int, num_seqs: int, num_logits: int, buckets: Sequence[int], max_num_seqs: int
) -> tuple[int, int, int]:
    """Padded (tokens, sequences, logits rows) for a step run eagerly at bucket shapes: each
    padded to its own bucket, sequences and rows at most `max_num_seqs` (a bucket graph pads
    sequences and logits rows to the token bucket, as its shape is fixed; eager ops take any
    shape, so a step with a prompt chunk does not compute an LM-head row per padded token slot).
    The step must fit the largest bucket."""
    tokens = bucket_for(num_tokens, buckets)
    if tokens is None:
        raise ValueError(f"a {num_tokens}-token step is above the largest bucket ({buckets[-1]})")
    seqs = max(num_seqs, min(bucket_for(num_seqs, buckets) or tokens, max_num_seqs))
    logits = max(num_logits, min(bucket_for(num_logits, buckets) or seqs, seqs))
    return tokens, seqs, logits


def pad_step(
    buffers: StepInputs,
    step: StepInputs,
    num_tokens: int,
    num_seqs: int,
    num_logits: int,
    width: int,
    *,
    logits_per_token: bool = False,
    views: FrontViews | None = None,
) -> StepInputs:
    """Pad `step` (views at the front of the persistent `buffers`) in place; return padded views
    (from `views`, a cache of views of `buffers`, when given).

    `num_tokens`, `num_seqs`, `num_logits` and `width` are the padded sizes (each >= the step's).
    Logits rows are at most one per sequence, or with `logits_per_token` (the dynamic graph, for
    steps with prompt logprobs) one per token.
    """
    n = step.slot_mapping.shape[0]
    s = step.seq_lens.shape[0]
    k = step.logits_indices.shape[0]
    w = step.block_tables.shape[1]
    for name, real, padded, room in (
        ("num_tokens", n, num_tokens, buffers.slot_mapping.shape[0]),
        ("num_seqs", s, num_seqs, buffers.seq_lens.shape[0]),
        ("num_logits", k, num_logits, buffers.logits_indices.shape[0]),
        ("width", w, width, buffers.block_tables.shape[1]),
    ):
        if not real <= padded <= room:
            raise ValueError(f"cannot pad {name} from {real} to {padded} (buffers hold {room})")
    if num_logits > num_seqs and not logits_per_token:
        raise ValueError(f"num_logits={num_logits} exceeds num_seqs={num_seqs}")

    # On the CPU through numpy views: a torch slice-and-fill costs a few microseconds of dispatch,
    # eight times a step, where numpy's costs a fraction of one.
    if views is not None and views.buffers is not buffers:
        raise ValueError("pad_step's views must be views of the buffers it pads")
    targets: tuple[Any, ...] = buffers
    if views is not None and views.arrays is not None:
        targets = views.arrays
    elif buffers.input_ids.is_cpu:
        targets = tuple(b.numpy() for b in buffers)
    input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc, logits_indices = targets
    input_ids[0, n:num_tokens] = 0
    positions[0, n:num_tokens] = 0
    slot_mapping[n:num_tokens] = -1
    seq_lens[s:num_seqs] = 0
    # Padded sequences own no query rows: their offsets all equal the real token count.
    query_start_loc[s + 1 : num_seqs + 1] = n
    block_tables[s:num_seqs, :width] = 0
    block_tables[:s, w:width] = 0
    logits_indices[k:num_logits] = 0
    if views is not None:
        return views(num_tokens, num_seqs, num_logits, width)
    return front_of(buffers, num_tokens, num_seqs, num_logits, width)
