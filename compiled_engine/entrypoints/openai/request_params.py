"""OpenAI request fields → the engine's `SamplingParams` (vLLM's field names).

Each endpoint lists what it sets as (SamplingParams field, value, the request's own name for it);
fields left out (None) keep the engine's defaults. SamplingParams validates the values itself: its
errors become 400s carrying its message and the request parameter it is about.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from compiled_engine.entrypoints.openai.errors import bad_request
from compiled_engine.entrypoints.openai.protocol import SamplingFields
from compiled_engine.errors import InvalidRequestError
from compiled_engine.sampling_params import SamplingParams


class Setting(NamedTuple):
    field: str  # SamplingParams' name
    value: Any  # None: not given
    param: str  # the request's name for it, for error messages


def common_settings(request: SamplingFields) -> list[Setting]:
    """The fields completions and chat share, mapped to SamplingParams' names."""
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    return [
        Setting("n", request.n, "n"),
        Setting("temperature", request.temperature, "temperature"),
        Setting("top_p", request.top_p, "top_p"),
        Setting("stop", stop or None, "stop"),
        Setting("seed", request.seed, "seed"),
        Setting("presence_penalty", request.presence_penalty, "presence_penalty"),
        Setting("frequency_penalty", request.frequency_penalty, "frequency_penalty"),
        Setting("logit_bias", _token_bias(request.logit_bias), "logit_bias"),
        Setting("top_k", request.top_k, "top_k"),
        Setting("min_p", request.min_p, "min_p"),
        Setting("repetition_penalty", request.repetition_penalty, "repetition_penalty"),
        Setting("min_tokens", request.min_tokens, "min_tokens"),
        Setting("ignore_eos", request.ignore_eos, "ignore_eos"),
        Setting("stop_token_ids", request.stop_token_ids or None, "stop_token_ids"),
    ]


def build_sampling_params(settings: list[Setting]) -> SamplingParams:
    kwargs = {s.field: s.value for s in settings if s.value is not None}
    try:
        return SamplingParams(**kwargs)
    except (InvalidRequestError, ValueError, TypeError) as exc:
        raise bad_request(str(exc), param=_param_named_in(str(exc), settings)) from exc


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings); the engine wants ints."""
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids", param="logit_bias") from None


def _param_named_in(message: str, settings: list[Setting]) -> str | None:
    """The request parameter an engine error message is about (SamplingParams' messages start
    with the field's name)."""
    for setting in settings:
        if message.startswith(f"{setting.field} "):
            return setting.param
    return None
