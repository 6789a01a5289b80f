"""What `LLM.generate` returns (field names follow vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# Per position: token id -> its Logprob (the chosen token and the top-N). vLLM's shapes.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it, if any
    # With SamplingParams.logprobs: one dict per generated token; else None. Lists are not
    # hashable, so they stay out of the hash.
    logprobs: SampleLogprobs | None = field(default=None, hash=False)
    cumulative_logprob: float | None = None  # sum of the generated tokens' logprobs (with logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]  # n of them, by index
    finished: bool  # every one of the n samples finished
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then one dict each.
    prompt_logprobs: PromptLogprobs | None = field(default=None, hash=False)
