"""How hidden states become one embedding: the pooling type and normalization (vLLM's names).

`PoolerConfig` is the `pooler_config` engine option as given (every field optional: a field left
None is read from the model folder's sentence-transformers files, else the model kind's default);
`PoolingSpec` is the resolved form the pooler runs. No torch here: engine_args.py imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# LAST: the sequence's last token (decoder-only embedders); MEAN: the mean of all its tokens;
# CLS: its first token (BERT-style).
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """The `pooler_config` option (vLLM's field names); None fields come from the folder."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(
                    f"pooler_config pooling_type {self.pooling_type!r} is not supported: "
                    f"choose one of {', '.join(POOLING_TYPES)}"
                )
            object.__setattr__(self, "pooling_type", self.pooling_type.upper())
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config normalize must be true or false, got {self.normalize!r}")


def parse_pooler_config(value: Any) -> PoolerConfig | None:
    """A `PoolerConfig` from None, a record, a mapping or its JSON text; ValueError naming the problem."""
    if value is None or isinstance(value, PoolerConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"pooler_config is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"pooler_config must be a dict (or its JSON text), got {type(value).__name__}")
    known = {f.name for f in fields(PoolerConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"pooler_config has unknown field(s) {unknown}; known: {sorted(known)}")
    return PoolerConfig(**value)


@dataclass(frozen=True)
class PoolingSpec:
    """What the pooler does for every request of one engine (resolved, checked)."""

    pooling_type: str  # one of POOLING_TYPES
    normalize: bool
    hidden_size: int  # the embedding's full width: the most `dimensions` may ask for
