"""Per-request sampling parameters, validated when constructed (vLLM's names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from compiled_engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept a single string or any iterable for the list-valued fields; store tuples so the
        # record stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise InvalidRequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if self.temperature < 0 or math.isinf(self.temperature):
            raise InvalidRequestError(f"temperature must be finite and >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise InvalidRequestError(f"top_k must be an int, got {self.top_k!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an int or None, got {self.seed!r}")
        if self.stop is not None:
            for s in self.stop:
                if not isinstance(s, str) or not s:
                    raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}")
        if self.stop_token_ids is not None:
            for t in self.stop_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise InvalidRequestError(f"stop_token_ids must be non-negative ints, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
