"""Per-request sampling parameters, validated when constructed (vLLM's names, defaults and meaning).

docs/sampling.md says what each one does and in which order the sampler applies them.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from compiled_engine.errors import InvalidRequestError


class RequestOutputKind(enum.Enum):
    """What each output of a request holds (vLLM's `RequestOutputKind`)."""

    CUMULATIVE = "cumulative"  # everything generated so far (vLLM's default)
    DELTA = "delta"  # only what is new since the request's previous output
    FINAL_ONLY = "final_only"  # one output, when the request has finished


# vLLM's default `max_logprobs`: the most top log-probabilities one token may ask for.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's shape): exactly one of `json` (a JSON
    schema, as a dict or its text), `json_object=True` (any JSON object), `regex`, `choice` (one of
    these strings) or `grammar` (EBNF, xgrammar's dialect of GBNF).

    Only the shape is checked here; whether the schema, regex or grammar itself is valid is checked
    by the backend when the request is added (compiled_engine/structured_output/)."""

    json: dict[str, Any] | str | None = field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's option: JSON without free whitespace between tokens (shorter, more deterministic).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, json_object, regex, choice or grammar, "
                f"got {given or 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as exc:
                    raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise InvalidRequestError(
                    f"structured_outputs.json must be a JSON schema (an object), got {type(parsed).__name__}"
                )
            try:
                # A private copy: later changes to the caller's dict cannot reach a request in flight.
                object.__setattr__(self, "json", json.loads(json.dumps(parsed)))
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(
                    f"structured_outputs.json is not JSON-serialisable: {exc}"
                ) from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be a non-empty string, got {value!r}"
                )
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice:
                raise InvalidRequestError(
                    f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}"
                )
            for option in self.choice:
                if not isinstance(option, str) or not option:
                    raise InvalidRequestError(
                        f"structured_outputs.choice entries must be non-empty strings, got {option!r}"
                    )
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise InvalidRequestError(
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError(
                "structured_outputs.disable_any_whitespace must be a bool, "
                f"got {self.disable_any_whitespace!r}"
            )

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def key(self) -> tuple[str, str, bool]:
        """Equal for constraints that compile to the same grammar (the compile cache's key)."""
        kind = self.kind
        if kind == "json":
            text = json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            text = json.dumps(list(self.choice or ()))
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text, self.disable_any_whitespace


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
    # Constrained decoding (JSON schema, regex, choice, grammar): docs/structured_outputs.md.
    structured_outputs: StructuredOutputsParams | None = field(default=None, hash=False)
    # What `LLMEngine.step()` reports for this request. `LLM.generate` sets FINAL_ONLY and the
    # async engine DELTA (their streams rebuild what their readers ask for), so a running
    # request costs neither a copy of its tokens nor an output record every step.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

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
        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidRequestError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise InvalidRequestError(
                "structured_outputs must be a StructuredOutputsParams, "
                f"got {type(self.structured_outputs).__name__}"
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
