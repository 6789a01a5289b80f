"""`POST /v1/completions`: prompt(s) in, text out, whole or streamed as server-sent events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from compiled_engine.engine.async_llm import AsyncLLM, EngineClosedError
from compiled_engine.entrypoints.openai.engine_requests import EngineRequests, engine_error
from compiled_engine.entrypoints.openai.errors import bad_request, error_json, not_supported
from compiled_engine.entrypoints.openai.logprobs import completion_logprobs
from compiled_engine.entrypoints.openai.prompt_tokenizer import PromptTokenizer
from compiled_engine.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from compiled_engine.entrypoints.openai.request_params import Setting, build_sampling_params, common_settings
from compiled_engine.entrypoints.openai.served_models import ServedModels
from compiled_engine.entrypoints.openai.streaming import DONE_EVENT, AbortingStreamingResponse, sse_event
from compiled_engine.entrypoints.openai.structured_request import extension_constraint
from compiled_engine.outputs import CompletionOutput


@dataclass(frozen=True)
class _Prompt:
    text: str | None  # None for a token-id prompt
    token_ids: list[int]


class OpenAIServingCompletion:
    def __init__(self, engine: AsyncLLM, models: ServedModels, tokenizer: PromptTokenizer) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer

    async def create(self, request: CompletionRequest):
        model = self.models.resolve(request.model)
        if request.suffix:
            raise not_supported("suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise not_supported("best_of", "only best_of == n")
        prompts = await self._prompts(request.prompt)
        params = [self._sampling_params(request, len(p.token_ids)) for p in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        requests = await EngineRequests.start(self.engine, request_id, [p.token_ids for p in prompts], params)
        if request.stream:
            events = self._stream(request, model, request_id, prompts, requests)
            return AbortingStreamingResponse(events, on_close=requests.abort_unfinished)
        finals = await requests.finals()
        choices = [
            self._choice(
                request,
                prompts[i],
                i * request.n + c.index,
                c,
                echo=request.echo,
                prompt_logprobs=final.prompt_logprobs,
            )
            for i, final in enumerate(finals)
            for c in final.outputs
        ]
        usage = _usage(prompts, sum(len(c.token_ids) for f in finals for c in f.outputs))
        body = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        return JSONResponse(body.model_dump())

    async def _prompts(self, prompt) -> list[_Prompt]:
        """Every accepted prompt form → text and token ids (text prompts are tokenized here)."""
        if isinstance(prompt, str):
            return [_Prompt(prompt, await self.tokenizer.encode(prompt))]
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        # Token-id prompts are checked by the engine (vocabulary, length).
        if isinstance(prompt[0], int):
            return [_Prompt(None, prompt)]
        if isinstance(prompt[0], list):
            return [_Prompt(None, p) for p in prompt]
        return [_Prompt(text, await self.tokenizer.encode(text)) for text in prompt]

    def _echo_text(self, prompt: _Prompt) -> str:
        # Decoded only once the engine accepted the ids (an id outside the vocabulary is its 400).
        if prompt.text is not None:
            return prompt.text
        return (
            self.tokenizer.tokenizer.decode(prompt.token_ids) if self.tokenizer.tokenizer is not None else ""
        )

    def _sampling_params(self, request: CompletionRequest, num_prompt_tokens: int):
        max_tokens = request.max_tokens
        if max_tokens is None:  # as vLLM: whatever the context has left
            max_tokens = max(1, self.engine.max_model_len - num_prompt_tokens)
        settings = common_settings(request)
        settings.append(Setting("max_tokens", max_tokens, "max_tokens"))
        settings.append(Setting("logprobs", request.logprobs, "logprobs"))
        constraint = extension_constraint(request.structured_outputs)
        settings.append(Setting("structured_outputs", constraint, "structured_outputs"))
        if request.echo and request.logprobs is not None:
            settings.append(Setting("prompt_logprobs", request.logprobs, "echo"))
        return build_sampling_params(settings)

    def _choice(
        self,
        request: CompletionRequest,
        prompt: _Prompt,
        index: int,
        completion: CompletionOutput,
        *,
        echo: bool,
        prompt_logprobs=None,
        text_offset: int = 0,
    ) -> CompletionChoice:
        """One choice; `echo` puts the prompt (and, with logprobs, its logprobs) in front."""
        text = self._echo_text(prompt) + completion.text if echo else completion.text
        logprobs = None
        if request.logprobs is not None:
            token_ids, steps = list(completion.token_ids), list(completion.logprobs or ())
            if echo:
                token_ids, steps = prompt.token_ids + token_ids, list(prompt_logprobs or ()) + steps
            logprobs = completion_logprobs(
                token_ids, steps, request.logprobs, self.tokenizer.decode_token, text_offset
            )
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    async def _stream(
        self,
        request: CompletionRequest,
        model: str,
        request_id: str,
        prompts: list[_Prompt],
        requests: EngineRequests,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.include_usage
        offsets: dict[int, int] = {}  # choice index -> characters sent so far
        completion_tokens = 0
        try:
            async for prompt_index, delta in requests.deltas():
                for completion in delta.outputs:
                    index = prompt_index * request.n + completion.index
                    completion_tokens += len(completion.token_ids)
                    if not (completion.token_ids or completion.finished or request.logprobs is not None):
                        continue
                    # New tokens whose text the detokenizer still holds back (part of a character)
                    # go out as a chunk with empty text, as vLLM sends them: a client sees every
                    # token when it is made, not two steps' worth in the next chunk.
                    choice = self._choice(
                        request,
                        prompts[prompt_index],
                        index,
                        completion,
                        echo=request.echo and index not in offsets,  # the prompt goes first, once
                        prompt_logprobs=delta.prompt_logprobs,
                        text_offset=offsets.get(index, 0),
                    )
                    offsets[index] = offsets.get(index, 0) + len(choice.text)
                    chunk = CompletionResponse(id=request_id, created=created, model=model, choices=[choice])
                    yield sse_event(chunk.model_dump_json(exclude=None if include_usage else {"usage"}))
            if include_usage:
                usage = _usage(prompts, completion_tokens)
                chunk = CompletionResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                )
                yield sse_event(chunk.model_dump_json())
        except EngineClosedError as exc:
            yield sse_event(error_json(engine_error(exc).message, type="engine_dead_error"))
        yield DONE_EVENT


def _usage(prompts: list[_Prompt], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
