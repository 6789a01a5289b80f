"""Turn a request's generated token ids into text a few tokens at a time, and find stop strings.

Decoding only the new token on its own is wrong for byte-level BPE (a token may hold half of a
UTF-8 character) and for SentencePiece (a token's leading space depends on its neighbours), and
decoding the whole output every step is quadratic. So we keep two offsets into the token list:
`prefix_offset..read_offset` is a short window already turned into text, and each step decodes
`prefix_offset..end`; the part past the window's own text is the new text. While the decoded tail
ends in U+FFFD (an incomplete character) we emit nothing and wait for the bytes that complete it.

Stop strings: after each step only the tail that could hold a newly completed match is searched.
The match that completes first wins (ties: the one that starts first), so the result does not
depend on how tokens were grouped into `append` calls; the text is cut just before it. While stop
strings are active, the last `max(len(stop)) - 1` characters are held back from the returned
deltas — they might turn out to be the start of a stop string — and released at the end of the
request by `flush()` or `append(..., finished=True)`. Callers must do one of the two when a request
ends for any reason other than a stop string, or that tail is lost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output, so the first output token is decoded in context
# (SentencePiece drops a leading space at the very start of a decode).
_PROMPT_CONTEXT_TOKENS = 5


def backend_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[..., str] | None:
    """The Rust tokenizer's own `decode`, where transformers' `decode` would return the same text.

    That holds for a `TokenizersBackend` that does not override `_decode` and does not clean up
    tokenization spaces: its `decode` then only converts the ids and calls this one. Each request
    decodes twice per step, so skipping the Python wrapper (about two thirds of a short decode's
    cost) matters at 64 requests a step. None: use `tokenizer.decode`.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or type(tokenizer)._decode is not TokenizersBackend._decode
        or tokenizer.clean_up_tokenization_spaces
        or backend is None
    ):
        return None
    return backend.decode


class IncrementalDetokenizer:
    """One request's output text, built incrementally.

    After `flush()` (or a stop string), `text` and the concatenation of every returned delta both
    equal `tokenizer.decode(output_token_ids, skip_special_tokens=...)`, cut before the stop string
    if one matched. That equality holds exactly for byte-level BPE tokenizers; for SentencePiece
    ones the text keeps the leading space that joins it to the prompt.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] | None = None,
        min_tokens: int = 0,
    ) -> None:
        """`min_tokens`: stop strings count only once that many tokens were generated (vLLM's rule:
        a match must end in text decoded from the min_tokens-th token on)."""
        stop = tuple(stop or ())
        for stop_string in stop:
            if not isinstance(stop_string, str) or not stop_string:
                raise ValueError(f"stop strings must be non-empty strings, got {stop_string!r}")
        self._tokenizer = tokenizer
        self._backend_decode = backend_decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        # (ids, skip_special_tokens) -> text, called twice per request every step: the Rust
        # decoder itself where it gives transformers' text, no Python frame in between.
        self._decode_ids: Callable[[list[int], bool], str] = self._backend_decode or self._transformers_decode
        self._stop = stop
        self._stop_holdback = max((len(s) for s in stop), default=1) - 1

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A context that itself ends mid-character (possible with raw token-id prompts) would merge
        # with the first output bytes and corrupt the window's arithmetic: decode without it.
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        # The decoding window only (ids before it are dropped as it moves): the request's token
        # ids are its TokenHistory's (engine/request.py), not this.
        self._token_ids: list[int] = context
        self._num_output_tokens = 0
        self._min_tokens = min_tokens
        self._prefix_offset = 0
        self._read_offset = len(context)

        self._text = ""
        self._num_emitted = 0
        self._flushed = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All output text decoded so far (complete characters only), cut before a matched stop string."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def append(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Add generated tokens; return the text that can now be shown (possibly "").

        `finished=True` says these are the request's last tokens: the return then includes
        everything held back, exactly as if `flush()` were called right after.
        """
        if self._flushed:
            raise RuntimeError("append() after flush(): this request's detokenizer is finished")
        # With async scheduling a token may still arrive after the stop string was found; it is
        # not part of the output.
        if self.stop_reason is not None:
            return ""
        if not new_token_ids:
            return self.flush() if finished else ""
        token_ids = self._token_ids
        token_ids.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        prefix_offset, decode, skip = self._prefix_offset, self._decode_ids, self._skip_special_tokens
        prefix_text = decode(token_ids[prefix_offset : self._read_offset], skip)
        window_text = decode(token_ids[prefix_offset:], skip)
        if len(window_text) > len(prefix_text) and not window_text.endswith(REPLACEMENT_CHAR):
            if self._stop:
                self._add_text(window_text[len(prefix_text) :])
            else:  # no stop string to look for (most requests)
                self._text += window_text[len(prefix_text) :]
            # The window moves to start at the old read offset; what precedes it is never decoded again.
            del token_ids[: self._read_offset]
            self._prefix_offset = 0
            self._read_offset = len(token_ids)
        if finished:
            return self._take_delta() + self.flush()
        if self._stop:
            return self._take_delta()
        # Nothing held back without stop strings: the delta is all the new text.
        delta = self._text[self._num_emitted :]
        self._num_emitted = len(self._text)
        return delta

    def flush(self) -> str:
        """The request is over: return everything held back, incomplete characters included (as U+FFFD)."""
        if self._flushed:
            return ""
        if not self.stopped and self._read_offset < len(self._token_ids):
            prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
            window_text = self._decode(self._token_ids[self._prefix_offset :])
            self._add_text(window_text[len(prefix_text) :])
            self._read_offset = len(self._token_ids)
        self._flushed = True
        return self._take_delta()

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids, self._skip_special_tokens)

    def _transformers_decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        # transformers annotates decode as `str | list[str]` whatever the input; one id list gives a str.
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)  # type: ignore[return-value]

    def _add_text(self, new_text: str) -> None:
        searched_before = len(self._text)
        self._text += new_text
        if not self._stop or self._num_output_tokens < self._min_tokens:
            return  # too early for stop strings; later searches start after this text
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_string in self._stop:
            # Everything before `searched_before` was already searched, so a new match must end
            # after it: start no earlier than len(stop_string) - 1 characters before.
            start = self._text.find(stop_string, max(0, searched_before - len(stop_string) + 1))
            if start != -1:
                candidate = (start + len(stop_string), start, stop_string)
                best = candidate if best is None else min(best, candidate)
        if best is not None:
            _, start, stop_string = best
            self._text = self._text[:start]
            self.stop_reason = stop_string

    def _take_delta(self) -> str:
        if self.stop_reason is not None or self._flushed:
            end = len(self._text)
        else:
            end = max(self._num_emitted, len(self._text) - self._stop_holdback)
        delta = self._text[self._num_emitted : end]
        self._num_emitted = end
        return delta
