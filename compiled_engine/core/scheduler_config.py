"""Limits the scheduler works within, fixed for the engine's lifetime."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    # Most requests in the running set (decode batch size ceiling).
    max_num_seqs: int
    # Token budget of one step: prefill chunks plus one token per decoding request.
    max_num_batched_tokens: int
    # Longest sequence (prompt + outputs) a request may reach.
    max_model_len: int
    block_size: int = 16
    num_kv_blocks: int

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "num_kv_blocks",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")

    @property
    def num_cache_tokens(self) -> int:
        """Tokens the whole KV cache can hold."""
        return self.num_kv_blocks * self.block_size
