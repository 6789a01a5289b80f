"""Grammar bitmasks of a step's sampling rows, applied to their logits before the sampler.

The scheduler attaches each constrained row's packed bitmask to its `ScheduledRequest`; the runner
gathers the step's into one `GrammarMasks` on the host and, on the execution stream, sets every
token a row's grammar forbids to -inf. Everything after it — logit_bias, min_tokens, penalties,
temperature, min-p, top-k/p, the draw and the sampled token's logprobs — sees the masked logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class GrammarMasks:
    rows: np.ndarray  # [C] int64: which sampling rows are constrained
    bitmask: np.ndarray  # [C, W] int32: xgrammar's packed masks, bit i of word j = token 32 j + i

    @classmethod
    def of_rows(cls, bitmasks: Sequence[np.ndarray | None]) -> GrammarMasks | None:
        """From each sampling row's bitmask (None: unconstrained); None when no row has one."""
        rows = [i for i, mask in enumerate(bitmasks) if mask is not None]
        if not rows:
            return None
        stacked = np.stack([mask for mask in bitmasks if mask is not None]).astype(np.int32, copy=False)
        return cls(np.asarray(rows, dtype=np.int64), stacked)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [K, vocab] with each constrained row's forbidden tokens at -inf (out of place)."""
        device = logits.device
        rows = torch.from_numpy(self.rows).to(device, non_blocking=True)
        words = torch.from_numpy(self.bitmask).to(device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((words[:, :, None] >> shifts) & 1).bool().reshape(words.shape[0], -1)
        vocab = logits.shape[1]
        if allowed.shape[1] < vocab:
            raise ValueError(f"grammar bitmask covers {allowed.shape[1]} tokens, the logits {vocab}")
        constrained = logits.index_select(0, rows).masked_fill(~allowed[:, :vocab], float("-inf"))
        return logits.index_copy(0, rows, constrained)
