"""Per-request pooling settings (vLLM's `PoolingParams` names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the embedding's first this many values (Matryoshka truncation), then
    normalize them if the model normalizes; `normalize`: override the model's normalization;
    `truncate_prompt_tokens`: keep only the input's last this many tokens (-1: as many as the
    model takes) instead of refusing a longer input."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive int, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True or False, got {self.normalize!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive int or -1, got {t!r}")
