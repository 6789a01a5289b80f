"""Turn what a user passed as a prompt into validated token ids, before anything is queued.

Accepted prompt forms (vLLM's):
  "some text"                            tokenized with the model's tokenizer (its default special tokens)
  {"prompt": "some text"}                the same
  {"prompt_token_ids": [1, 2, 3]}        used as given (list or tuple of ints in [0, vocab_size))
Every problem is an InvalidRequestError that names the request and what is wrong with it.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

from compiled_engine.errors import InvalidRequestError
from compiled_engine.model_loader.model_config import ModelConfig
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.structured_output.compiler import GrammarCompilerPool

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None  # the text, when the user gave text
    prompt_token_ids: tuple[int, ...]


class ValidatedPrompt(NamedTuple):
    """One prompt of a batch, checked and paired with its own SamplingParams."""

    processed: ProcessedPrompt
    sampling_params: SamplingParams


class InputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        model_config: ModelConfig,
        max_model_len: int | None = None,
        *,
        grammars: GrammarCompilerPool | None = None,
    ) -> None:
        """`max_model_len` caps prompt + generated tokens; None means the model's max_position_embeddings."""
        if max_model_len is None:
            max_model_len = model_config.max_position_embeddings
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        self._tokenizer = tokenizer
        # Parses (and starts compiling) structured-output constraints; None: they are refused.
        self._grammars = grammars
        self._vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len

    def process(self, prompt, sampling_params: SamplingParams, request_id: str) -> ProcessedPrompt:
        """Tokenize and check one prompt; raise InvalidRequestError if it cannot be served."""
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidRequestError(
                f"request {request_id}: sampling_params must be a SamplingParams, "
                f"got {type(sampling_params).__name__}"
            )
        text, raw_token_ids = self._token_ids(prompt, request_id)
        token_ids = self._checked_token_ids(raw_token_ids, request_id)
        self._check_length(len(token_ids), sampling_params.max_tokens, request_id)
        self._check_against_vocab(sampling_params, request_id)
        self._check_structured_outputs(sampling_params, request_id)
        return ProcessedPrompt(prompt=text, prompt_token_ids=token_ids)

    def validate_batch(self, prompts, sampling_params=None) -> list[ValidatedPrompt]:
        """Check every prompt of a batch (and pair it with its SamplingParams) before any is queued.

        `prompts`: one prompt or a list/tuple of them. `sampling_params`: None (defaults for all),
        one SamplingParams (shared), or a list with one per prompt.
        """
        prompt_list = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        elif isinstance(sampling_params, (list, tuple)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"got {len(prompt_list)} prompts but {len(params_list)} sampling_params; "
                    "pass one SamplingParams to share, or exactly one per prompt"
                )
        else:
            raise InvalidRequestError(
                "sampling_params must be None, a SamplingParams or a list of them, "
                f"got {type(sampling_params).__name__}"
            )
        for i, params in enumerate(params_list):
            if not isinstance(params, SamplingParams):
                raise InvalidRequestError(
                    f"sampling_params[{i}] must be a SamplingParams, got {type(params).__name__}"
                )
        return [
            ValidatedPrompt(self.process(prompt, params, request_id=f"prompt[{i}]"), params)
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True))
        ]

    def _token_ids(self, prompt, request_id: str) -> tuple[str | None, tuple]:
        if isinstance(prompt, dict):
            keys = set(prompt)
            unknown = keys - set(_PROMPT_KEYS)
            if unknown:
                raise InvalidRequestError(
                    f"request {request_id}: prompt dict has unsupported key(s) {sorted(map(str, unknown))}; "
                    f"use exactly one of {list(_PROMPT_KEYS)}"
                )
            if len(keys) != 1:
                raise InvalidRequestError(
                    f"request {request_id}: prompt dict must have exactly one of {list(_PROMPT_KEYS)}, "
                    f"got {sorted(keys)}"
                )
            if "prompt" in prompt:
                return prompt["prompt"], self._tokenize(prompt["prompt"], request_id)
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise InvalidRequestError(
                    f"request {request_id}: prompt_token_ids must be a list of ints, got {type(ids).__name__}"
                )
            return None, tuple(ids)
        if isinstance(prompt, str):
            return prompt, self._tokenize(prompt, request_id)
        hint = " (token ids go in {'prompt_token_ids': [...]})" if isinstance(prompt, (list, tuple)) else ""
        raise InvalidRequestError(
            f"request {request_id}: a prompt must be a str or a dict with 'prompt' or 'prompt_token_ids', "
            f"got {type(prompt).__name__}{hint}"
        )

    def _tokenize(self, text, request_id: str) -> tuple:
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"request {request_id}: prompt text must be a str, got {type(text).__name__}"
            )
        if not text:
            raise InvalidRequestError(f"request {request_id}: the prompt is empty")
        if self._tokenizer is None:
            raise InvalidRequestError(
                f"request {request_id}: this model has no tokenizer; "
                "pass {'prompt_token_ids': [...]} instead of text"
            )
        return tuple(self._tokenizer.encode(text))

    def _checked_token_ids(self, token_ids: Sequence, request_id: str) -> tuple[int, ...]:
        if not token_ids:
            raise InvalidRequestError(f"request {request_id}: the prompt is empty (no token ids)")
        checked = []
        for position, token_id in enumerate(token_ids):
            # bool is an int subclass, but True as a token id is a bug, not a token.
            if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
                raise InvalidRequestError(
                    f"request {request_id}: prompt token {position} is {token_id!r} "
                    f"({type(token_id).__name__}), not an int"
                )
            # Plain ints from here on (numpy integers pass the check above).
            value = int(token_id)
            if not 0 <= value < self._vocab_size:
                raise InvalidRequestError(
                    f"request {request_id}: prompt token {position} is {value}, outside the "
                    f"model's vocabulary [0, {self._vocab_size})"
                )
            checked.append(value)
        return tuple(checked)

    def _check_against_vocab(self, params: SamplingParams, request_id: str) -> None:
        """What SamplingParams cannot check alone: token ids and logprob counts within the vocabulary."""
        for token_id in params.logit_bias or ():
            if token_id >= self._vocab_size:
                raise InvalidRequestError(
                    f"request {request_id}: logit_bias token {token_id} is outside the model's "
                    f"vocabulary [0, {self._vocab_size})"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self._vocab_size:
                raise InvalidRequestError(
                    f"request {request_id}: {name}={value} is more than the model's {self._vocab_size} tokens"
                )

    def _check_structured_outputs(self, params: SamplingParams, request_id: str) -> None:
        """A bad schema, regex or grammar is refused here; a good one starts compiling now."""
        if params.structured_outputs is None:
            return
        if self._grammars is None:
            raise InvalidRequestError(
                f"request {request_id}: this engine does not support structured outputs"
            )
        try:
            self._grammars.submit(params.structured_outputs)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"request {request_id}: {exc}") from None

    def _check_length(self, num_prompt_tokens: int, max_tokens: int, request_id: str) -> None:
        if num_prompt_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"request {request_id}: the prompt has {num_prompt_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"request {request_id}: the prompt has {num_prompt_tokens} tokens and max_tokens is "
                f"{max_tokens}: {num_prompt_tokens + max_tokens} tokens in all, more than "
                f"max_model_len={self.max_model_len}"
            )
