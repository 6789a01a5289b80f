"""Grammar bitmasks of a step's sampling rows, applied to their logits before the sampler.

The scheduler attaches each constrained row's packed bitmask to its `ScheduledRequest`; the runner
gathers the step's into one `GrammarMasks` on the host and, on the execution stream, sets every
token a row's grammar forbids to -inf (xgrammar's kernel). Everything after it — logit_bias,
min_tokens, penalties, temperature, min-p, top-k/p, the draw and the sampled token's logprobs —
sees the masked logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class GrammarMasks:
    rows: tuple[int, ...]  # which sampling rows are constrained
    # [K, W] int32, one row per sampling row (all ones where unconstrained): xgrammar's packed
    # masks, bit i of word j = token 32 j + i.
    bitmask: np.ndarray

    @classmethod
    def of_rows(cls, bitmasks: Sequence[np.ndarray | None]) -> GrammarMasks | None:
        """From each sampling row's bitmask (None: unconstrained); None when no row has one."""
        rows = tuple(i for i, mask in enumerate(bitmasks) if mask is not None)
        if not rows:
            return None
        words = next(mask for mask in bitmasks if mask is not None).shape[0]
        full = np.full((len(bitmasks), words), -1, dtype=np.int32)
        for i, mask in enumerate(bitmasks):
            if mask is not None:
                full[i] = mask
        return cls(rows, full)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [K, vocab] as float32 with each constrained row's forbidden tokens at -inf.

        In place when they are float32 already (the sampling rows' logits are read by nothing
        else): xgrammar's kernel for the device (C++ on CPU, CUDA/Triton on GPUs), one call."""
        import xgrammar as xgr  # imported on first use: it takes seconds

        logits = logits.float()
        vocab = logits.shape[1]
        if self.bitmask.shape[1] * 32 < vocab:
            raise ValueError(
                f"grammar bitmask covers {self.bitmask.shape[1] * 32} tokens, the logits {vocab}"
            )
        bitmask = torch.from_numpy(self.bitmask).to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=list(self.rows))
        return logits
