"""The engine's per-token logprobs → OpenAI's two shapes (completions and chat).

The engine reports, per generated token, a dict {token id: Logprob} holding the sampled token and
the top-N alternatives (vLLM's layout, compiled_engine/outputs.py). A token's text is its own
decode, so a token holding part of a multi-byte character shows as U+FFFD; chat's `bytes` field
carries the UTF-8 bytes of that text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from compiled_engine.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogProbs,
    TopLogprob,
)
from compiled_engine.outputs import Logprob

TokenText = Callable[[int], str]
Step = Mapping[int, Logprob]
# JSON has no -inf; vLLM reports this for a sampled token missing from the engine's dict.
MISSING_LOGPROB = -9999.0


def _text(token_id: int, entry: Logprob | None, token_text: TokenText) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return token_text(token_id)


def _chosen(token_id: int, step: Step) -> float:
    entry = step.get(token_id)
    return MISSING_LOGPROB if entry is None else entry.logprob


def _top(step: Step, limit: int) -> list[tuple[int, Logprob]]:
    """The `limit` most likely entries of one step, most likely first."""
    return sorted(step.items(), key=lambda item: -item[1].logprob)[:limit]


def completion_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[Step | None],
    num_top: int,
    token_text: TokenText,
    text_offset: int,
) -> CompletionLogProbs:
    """Completions' layout: parallel lists; offsets count characters from `text_offset`.
    A step may be None: an echoed prompt's first token, which nothing precedes."""
    out = CompletionLogProbs()
    offset = text_offset
    for token_id, step in zip(token_ids, steps, strict=True):
        text = _text(token_id, None if step is None else step.get(token_id), token_text)
        out.tokens.append(text)
        out.token_logprobs.append(None if step is None else _chosen(token_id, step))
        out.top_logprobs.append(
            _top_by_text(step, num_top, token_text) if step is not None and num_top else None
        )
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _top_by_text(step: Step, num_top: int, token_text: TokenText) -> dict[str, float]:
    """Completions key alternatives by their text; tokens that decode alike (partial UTF-8 bytes
    all show as U+FFFD) keep the most likely one's logprob."""
    top: dict[str, float] = {}
    for token_id, entry in _top(step, num_top):
        top.setdefault(_text(token_id, entry, token_text), entry.logprob)
    return top


def chat_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[Step],
    num_top: int,
    token_text: TokenText,
) -> ChatChoiceLogprobs:
    """Chat's layout: one record per token, with its top alternatives and UTF-8 bytes."""

    def top_entry(token_id: int, entry: Logprob) -> TopLogprob:
        text = _text(token_id, entry, token_text)
        return TopLogprob(token=text, logprob=entry.logprob, bytes=list(text.encode("utf-8")))

    content = []
    for token_id, step in zip(token_ids, steps, strict=True):
        text = _text(token_id, step.get(token_id), token_text)
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=_chosen(token_id, step),
                bytes=list(text.encode("utf-8")),
                top_logprobs=[top_entry(t, entry) for t, entry in _top(step, num_top)],
            )
        )
    return ChatChoiceLogprobs(content=content)
