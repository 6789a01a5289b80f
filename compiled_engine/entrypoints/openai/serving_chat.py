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
from compiled_engine.entrypoints.openai.structured_request import ToolPlan, chat_constraint, tool_calls
from compiled_engine.entrypoints.openai.tool_call_stream import ToolCallStream
from compiled_engine.entrypoints.openai.tool_parsers import HermesToolCallParser, ToolCallParser
from compiled_engine.outputs import CompletionOutput
from compiled_engine.sampling_params import StructuredOutputsParams


class OpenAIServingChat:
    def __init__(
        self,
        engine: AsyncLLM,
        models: ServedModels,
        tokenizer: PromptTokenizer,
        tool_parser: ToolCallParser | None = None,
    ) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = tokenizer
        # Reads tool calls out of replies to tool_choice "auto" (--tool-call-parser).
        self.tool_parser = tool_parser or HermesToolCallParser()

    async def create(self, request: ChatCompletionRequest):
        model = self.models.resolve(request.model)
        _check_supported(request)
        constraint, tool_plan = chat_constraint(request, self.tool_parser)
        prompt = await self.tokenizer.encode_chat(
            [_template_message(m) for m in request.messages],
            request.add_generation_prompt,
            tools=request.tools if tool_plan is not None else None,
        )
        params = self._sampling_params(request, len(prompt), constraint)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        requests = await EngineRequests.start(self.engine, request_id, [prompt], [params])
        if request.stream:
            events = self._stream(request, model, request_id, len(prompt), requests, tool_plan)
            return AbortingStreamingResponse(events, on_close=requests.abort_unfinished)
        (final,) = await requests.finals()
        choices = [
            ChatCompletionChoice(
                index=c.index,
                message=_message(c.text, tool_plan),
                logprobs=self._logprobs(request, c),
                finish_reason=_finish_reason(c.finish_reason, choice_calls(c.text, tool_plan)),
                stop_reason=c.stop_reason,
            )
            for c in final.outputs
        ]
        usage = _usage(len(prompt), sum(len(c.token_ids) for c in final.outputs))
        body = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        return JSONResponse(body.model_dump())

    def _sampling_params(
        self,
        request: ChatCompletionRequest,
        num_prompt_tokens: int,
        constraint: StructuredOutputsParams | None = None,
    ):
        max_tokens = request.max_completion_tokens or request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        if max_tokens is None:  # OpenAI's default: as long as the context allows
            max_tokens = max(1, self.engine.max_model_len - num_prompt_tokens)
        settings = common_settings(request)
        settings.append(Setting("max_tokens", max_tokens, param))
        if request.logprobs:
            settings.append(Setting("logprobs", request.top_logprobs or 0, "top_logprobs"))
        settings.append(Setting("structured_outputs", constraint, "response_format"))
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
        tool_plan: ToolPlan | None = None,
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
        tool_streams = {i: ToolCallStream(tool_plan) for i in range(request.n)} if tool_plan else {}
        try:
            async for _, delta in requests.deltas():
                choices = []
                for c in delta.outputs:
                    finish_reason = c.finish_reason
                    if tool_plan is None:
                        # New tokens whose text the detokenizer still holds back (part of a
                        # character) go out with empty content, as vLLM sends them, so a client
                        # sees every token when it is made.
                        ending = c.finished and not c.text  # OpenAI ends a choice with an empty delta
                        message = DeltaMessage() if ending else DeltaMessage(content=c.text)
                        send = bool(c.token_ids or c.finished or request.logprobs)
                    else:
                        # What the tool-call parser holds back (a possible call) has nothing to send.
                        message, finish_reason = _tool_delta(tool_streams[c.index], c)
                        send = bool(message.content or message.tool_calls or c.finished or request.logprobs)
                    if send:
                        choices.append(
                            ChatCompletionStreamChoice(
                                index=c.index,
                                delta=message,
                                logprobs=self._logprobs(request, c),
                                finish_reason=finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        )
                completion_tokens += sum(len(c.token_ids) for c in delta.outputs)
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], _usage(num_prompt_tokens, completion_tokens))
        except EngineClosedError as exc:
            yield sse_event(error_json(engine_error(exc).message, type="engine_dead_error"))
        yield DONE_EVENT


def _message(text: str, tool_plan: ToolPlan | None) -> AssistantMessage:
    if tool_plan is None:
        return AssistantMessage(content=text)
    parsed = tool_plan.parse(text)
    return AssistantMessage(content=parsed.content, tool_calls=tool_calls(parsed.tool_calls) or None)


def choice_calls(text: str, tool_plan: ToolPlan | None) -> bool:
    """Whether a finished reply holds tool calls."""
    return tool_plan is not None and bool(tool_plan.parse(text).tool_calls)


def _finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    # OpenAI's: a reply that ended by itself with calls in it ends for "tool_calls".
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


def _tool_delta(stream: ToolCallStream, completion: CompletionOutput) -> tuple[DeltaMessage, str | None]:
    message = stream.feed(completion.text) or DeltaMessage()
    if not completion.finished:
        return message, None
    rest = stream.finish()
    if rest is not None:
        content = (message.content or "") + (rest.content or "")
        message = DeltaMessage(
            content=content or None,
            tool_calls=[*(message.tool_calls or []), *(rest.tool_calls or [])] or None,
        )
    return message, _finish_reason(completion.finish_reason, stream.has_tool_calls)


def _check_supported(request: ChatCompletionRequest) -> None:
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
    out: dict = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
