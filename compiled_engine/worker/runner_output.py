"""The record the model runner returns to the scheduler each step."""

from __future__ import annotations

from typing import NamedTuple


class ModelRunnerOutput(NamedTuple):
    # One entry per scheduled request with sample=True, in scheduling order.
    request_ids: tuple[str, ...]
    sampled_token_ids: tuple[int, ...]
