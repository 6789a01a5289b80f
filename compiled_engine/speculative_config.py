"""Speculative decoding's settings (vLLM's `speculative_config` shape), checked once.

`LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})`, or on the command line
`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`; or a smaller model with
the target's tokenizer proposing: `{"method": "draft_model", "model": DIR, "num_speculative_tokens":
4}`. docs/speculative_decoding.md says how each works.

Like `sampling_params`, this module imports nothing of the engine: the scheduler's config, the
engine's options and the CLI all read the same frozen record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# Methods this engine implements; others vLLM knows are refused by name.
SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's defaults for prompt lookup: when neither bound is given both are 5, when one is given
# the other takes its value.
DEFAULT_PROMPT_LOOKUP = 5
# Above this many running requests a step is verified without proposals (vLLM's
# `disable_by_batch_size`; None there means never). The engine's default comes from
# `python -m bench.speculative` (docs/performance.md, "Speculative decoding"): on the CPU, n-gram
# with k = 4 paid at 1 and 2 requests and cost at 4, where verifying k extra tokens per request is
# no longer nearly free.
DEFAULT_DISABLE_BY_BATCH_SIZE = 2


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """One checked `speculative_config`."""

    method: str
    num_speculative_tokens: int  # k: proposals verified per request and step
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP  # shortest suffix n-gram looked up
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP  # longest suffix n-gram looked up
    # Steps with more running requests than this speculate for none of them.
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # method "draft_model": the draft's folder (the target's tokenizer and vocabulary, checked at
    # load); None for "ngram".
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: unknown method {self.method!r}: choose one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str | os.PathLike) or not str(self.model):
                raise ValueError(
                    "speculative_config: method 'draft_model' needs 'model', the draft model's folder"
                )
            object.__setattr__(self, "model", str(self.model))
            if not os.path.isdir(self.model):
                raise ValueError(
                    f"speculative_config: the draft model folder {self.model!r} does not exist "
                    "or is not a directory"
                )
        elif self.model is not None:
            raise ValueError(f"speculative_config: 'model' is for method 'draft_model', not {self.method!r}")
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def parse_speculative_config(
    value: SpeculativeConfig | Mapping[str, Any] | str | None,
) -> SpeculativeConfig | None:
    """The option as given — a dict (vLLM's shape), its JSON text (the CLI), a record, or None
    (no speculation) — as a checked record; every error names the key at fault."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if value is None:
            return None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"speculative_config must be a dict like {{'method': 'ngram', 'num_speculative_tokens': 4}}, "
            f"got {type(value).__name__}"
        )
    given = dict(value)
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
    if "method" not in given:
        raise ValueError(
            "speculative_config needs a 'method' (one of: " + ", ".join(SPECULATIVE_METHODS) + ")"
        )
    if given["method"] not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config: unknown method {given['method']!r}: choose one of "
            f"{', '.join(SPECULATIVE_METHODS)}"
        )
    if "num_speculative_tokens" not in given:
        raise ValueError("speculative_config needs 'num_speculative_tokens' (proposals per step, >= 1)")
    low, high = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    elif low is None:
        low = high
    elif high is None:
        high = low
    given["prompt_lookup_min"], given["prompt_lookup_max"] = low, high
    if given.get("disable_by_batch_size") is None:
        given["disable_by_batch_size"] = DEFAULT_DISABLE_BY_BATCH_SIZE
    return SpeculativeConfig(**given)
