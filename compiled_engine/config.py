"""Engine-wide settings, resolved once from the user's arguments and the model's config."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int
    seed: int
