"""Per-request sampling parameters, validated when constructed (vLLM's names, defaults and meaning).

docs/sampling.md says what each one does and in which order the sampler applies them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from compiled_engine.errors import InvalidRequestError

# vLLM's default `max_logprobs`: the most top log-probabilities one token may ask for.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    # The first eight in their original order, for callers that pass them by position.
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    n: int = 1
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> bias added to its logit. Left out of the hash (a dict is not hashable); equality
    # still compares it.
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept a single string or any iterable for the list-valued fields; store tuples so the
        # record stays immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()
        if self.logit_bias is not None:
            # A private copy with plain int/float: later changes to the caller's dict cannot
            # reach a request in flight.
            bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            object.__setattr__(self, "logit_bias", bias)

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be finite and >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k, minimum=-1)
        if self.top_k == 0:
            raise InvalidRequestError(f"top_k must be -1 (disabled) or at least 1, got {self.top_k}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError(
                    f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}"
                )
            for token_id, bias in self.logit_bias.items():
                if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral) or token_id < 0:
                    raise InvalidRequestError(
                        f"logit_bias keys must be non-negative token ids, got {token_id!r}"
                    )
                if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not math.isfinite(bias):
                    raise InvalidRequestError(
                        f"logit_bias values must be finite numbers, got {bias!r} for token {token_id}"
                    )
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
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise InvalidRequestError(
                        f"{name} must be None or in [0, {MAX_LOGPROBS}] (the engine's max_logprobs), "
                        f"got {value}"
                    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits (they all need the request's token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _check_int(name: str, value, *, minimum: int) -> None:
    # bool is an int subclass, but True as a count is a bug, not a number.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(f"{name} must be at least {minimum}, got {value}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
