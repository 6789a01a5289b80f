"""`POST /v1/chat/completions`: messages rendered by the model's chat template, one assistant reply
per choice, whole or streamed as server-sent events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from compiled_engine.engine.async_llm import AsyncLLM, EngineClosedError
from compiled_engine.entrypoints.openai.engine_requests import EngineRequests, engine_error
from compiled_engine.entrypoints.openai.errors import bad_request, error_json, not_supported
from compiled_engine.entrypoints.openai.logprobs import chat_logprobs
from compiled_engine.entrypoints.openai.prompt_tokenizer import PromptTokenizer
from compiled_engine.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
)
from compiled_engine.entrypoints.openai.request_params import Setting, build_sampling_params, common_settings
from compiled_engine.entrypoints.openai.served_models import ServedModels
from compiled_engine.entrypoints.openai.streaming import DONE_EVENT, AbortingStreamingResponse, sse_event
from compiled_engine.outputs import CompletionOutput


class OpenAIServingChat:
    def __init__(self, engine: AsyncLLM, models: ServedModels, tokenizer: PromptTokenizer) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer

    async def create(self, request: ChatCompletionRequest):
        model = self.models.resolve(request.model)
        _check_supported(request)
        prompt = await self.tokenizer.encode_chat(
            [_template_message(m) for m in request.messages], request.add_generation_prompt
        )
        params = self._sampling_params(request, len(prompt))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        requests = await EngineRequests.start(self.engine, request_id, [prompt], [params])
        if request.stream:
            events = self._stream(request, model, request_id, len(prompt), requests)
            return AbortingStreamingResponse(events, on_close=requests.abort_unfinished)
        (final,) = await requests.finals()
        choices = [
            ChatCompletionChoice(
                index=c.index,
                message=AssistantMessage(content=c.text),
                logprobs=self._logprobs(request, c),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in final.outputs
        ]
        usage = _usage(len(prompt), sum(len(c.token_ids) for c in final.outputs))
        body = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        return JSONResponse(body.model_dump())

    def _sampling_params(self, request: ChatCompletionRequest, num_prompt_tokens: int):
        max_tokens = request.max_completion_tokens or request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        if max_tokens is None:  # OpenAI's default: as long as the context allows
            max_tokens = max(1, self.engine.max_model_len - num_prompt_tokens)
        settings = common_settings(request)
        settings.append(Setting("max_tokens", max_tokens, param))
        if request.logprobs:
            settings.append(Setting("logprobs", request.top_logprobs or 0, "top_logprobs"))
        return build_sampling_params(settings)

    def _logprobs(
        self, request: ChatCompletionRequest, completion: CompletionOutput
    ) -> ChatChoiceLogprobs | None:
        if not request.logprobs:
            return None
        return chat_logprobs(
            completion.token_ids,
            completion.logprobs or (),
            request.top_logprobs or 0,
            self.tokenizer.decode_token,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        model: str,
        request_id: str,
        num_prompt_tokens: int,
        requests: EngineRequests,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = request.include_usage
        exclude = None if include_usage else {"usage"}

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            body = ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=choices, usage=usage
            )
            return sse_event(body.model_dump_json(exclude=exclude))

        # OpenAI opens every choice with the assistant role and empty content.
        for index in range(request.n):
            yield chunk(
                [ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))]
            )
        completion_tokens = 0
        try:
            async for _, delta in requests.deltas():
                choices = [
                    ChatCompletionStreamChoice(
                        index=c.index,
                        delta=DeltaMessage(content=c.text) if c.text else DeltaMessage(),
                        logprobs=self._logprobs(request, c),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    for c in delta.outputs
                    # Tokens whose text the detokenizer still holds back have nothing to send.
                    if c.text or c.finished or request.logprobs
                ]
                completion_tokens += sum(len(c.token_ids) for c in delta.outputs)
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], _usage(num_prompt_tokens, completion_tokens))
        except EngineClosedError as exc:
            yield sse_event(error_json(engine_error(exc).message, type="engine_dead_error"))
        yield DONE_EVENT


def _check_supported(request: ChatCompletionRequest) -> None:
    if request.tools:
        raise not_supported("tools")
    if request.response_format and request.response_format.get("type", "text") != "text":
        raise not_supported("response_format", "only plain text replies")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")


def _template_message(message: ChatMessage) -> dict:
    """A message as chat templates expect it: content always one string."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise not_supported("messages", f"content parts of type {part.type!r}; only text")
            texts.append(part.text)
        content = "\n".join(texts)
    out = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
