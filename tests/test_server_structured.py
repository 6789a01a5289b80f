"""Structured outputs and tool calling through the server, driven by the official `openai` client
on the embedded model: response_format, vLLM's structured_outputs field, tools with each
tool_choice (streamed and not), and the 400s for bad constraints and tools."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from compiled_engine.engine.async_llm import AsyncLLM
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_args import EngineArgs
from compiled_engine.entrypoints.openai.api_server import build_app
from compiled_engine.entrypoints.openai.tool_parsers import HermesToolCallParser
from tests.structured_workload import NESTED, PERSON
from tests.test_server import ServerThread

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "describe", "parameters": PERSON}},
]
SCHEMAS = {"get_weather": WEATHER, "describe": PERSON}
# Replies are seeded: each case is one fixed sample at temperature 1.
SAMPLED = dict(temperature=1.0, seed=7, max_tokens=200)


@pytest.fixture(scope="module")
def server():
    args = EngineArgs(enforce_eager=True, dtype="float32", max_model_len=512, num_kv_blocks=128)
    engine = AsyncLLM(LLMEngine(args))
    thread = ServerThread(build_app(engine, served_model_names=["default"]))
    yield thread
    thread.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _check_calls(tool_calls) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_response_format_json_schema_whole_and_streamed(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = client.chat.completions.create(
        model="default", messages=MESSAGES, response_format=response_format, **SAMPLED
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(
        model="default", messages=MESSAGES, response_format=response_format, stream=True, **SAMPLED
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == choice.message.content  # same seed, same reply


def test_response_format_json_object(client):
    reply = client.chat.completions.create(
        model="default", messages=MESSAGES, response_format={"type": "json_object"}, **SAMPLED
    )
    choice = reply.choices[0]
    # Any keys, any values: the tiny model may well run out of tokens inside a string first.
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


def test_structured_outputs_extension_in_completions_and_chat(client):
    completion = client.completions.create(
        model="default",
        prompt="The code is",
        n=3,
        **SAMPLED,
        extra_body={"structured_outputs": {"regex": r"[A-F0-9]{4}-[0-9]{2}"}},
    )
    for choice in completion.choices:
        assert re.fullmatch(r"[A-F0-9]{4}-[0-9]{2}", choice.text), choice.text
    chat = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        **SAMPLED,
        extra_body={"structured_outputs": {"json": NESTED, "disable_any_whitespace": True}},
    )
    jsonschema.validate(json.loads(chat.choices[0].message.content), NESTED)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_required_and_named_tool_calls_validate(client, tool_choice, stream):
    choice = (
        "required" if tool_choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    )
    kwargs = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice=choice, **SAMPLED)
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "tool_calls"
        assert reply.choices[0].message.content is None
        calls = reply.choices[0].message.tool_calls
    else:
        calls = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    _check_calls(calls)
    if tool_choice == "named":
        assert [c.function.name for c in calls] == ["get_weather"]


class _Call:
    def __init__(self) -> None:
        self.id = self.type = self.name = None
        self.arguments = ""

    @property
    def function(self):
        return self


def _streamed_calls(stream) -> list[_Call]:
    """Tool-call deltas put back together, as a client does (by index)."""
    calls: dict[int, _Call] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, _Call())
                call.id = delta.id or call.id
                call.type = delta.type or call.type
                if delta.function is not None:
                    call.name = delta.function.name or call.name
                    call.arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_tool_choice_parses_hermes_calls_from_the_reply(client, stream):
    # The reply is forced (by a regex) into the Hermes format the "auto" parser reads.
    forced = (
        r'Checking\. <tool_call>\{"name": "get_weather", '
        r'"arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
    )
    kwargs = dict(
        model="default",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="auto",
        **SAMPLED,
        extra_body={"structured_outputs": {"regex": forced}},
    )
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls"
        assert message.content == "Checking."
        calls = message.tool_calls
    else:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content.strip() == "Checking."
        calls = _streamed_calls(iter(chunks))
    _check_calls(calls)


def test_tool_choice_none_answers_in_plain_text(client):
    reply = client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0.0
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, param, message",
    [
        (dict(tools=[{"type": "function", "function": {"parameters": WEATHER}}]), "tools", "has no name"),
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}),
            "tool_choice",
            "'fly', which is not among the tools",
        ),
        (dict(tool_choice="required"), "tool_choice", "needs tools"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format",
            "needs json_schema.schema",
        ),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}),
            "response_format",
            'Unsupported type "wat"',
        ),
        (
            dict(extra_body={"structured_outputs": {"regex": "a(b"}}),
            "structured_outputs",
            "parenthesis is not closed",
        ),
        (
            dict(extra_body={"structured_outputs": {"json": {"type": "integer", "multipleOf": 2}}}),
            "structured_outputs",
            "multipleOf",
        ),
        (dict(extra_body={"structured_outputs": {"yaml": "x"}}), "structured_outputs", "unsupported key"),
    ],
)
def test_bad_constraints_and_tools_are_400_naming_the_problem(client, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4, **kwargs)
    error = caught.value.body
    assert error["param"] == param
    assert message in error["message"]
    # The server goes on serving.
    assert client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2).choices


def test_hermes_parser_holds_back_a_possible_tag_while_streaming():
    parser = HermesToolCallParser()
    assert parser.content_prefix_length("Hello <tool") == len("Hello ")
    assert parser.content_prefix_length("Hello <b>") == len("Hello <b>")
    assert parser.content_prefix_length('Hi <tool_call>{"na') == len("Hi ")
    parsed = parser.parse('Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert parsed.content == "Hi" and parsed.tool_calls[0].name == "f"
    assert json.loads(parsed.tool_calls[0].arguments) == {"a": 1}
    assert parser.parse("<tool_call>{broken</tool_call>").tool_calls == ()


def test_unknown_tool_call_parser_is_refused_by_name():
    from compiled_engine.engine_args import ServerArgs
    from compiled_engine.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS, tool_call_parser

    with pytest.raises(ValueError, match=r"tool_call_parser must be one of \['hermes'\], got 'mistral'"):
        ServerArgs(tool_call_parser="mistral")
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral'"):
        tool_call_parser("mistral")
    # Every name the flag offers has a parser behind it.
    from compiled_engine.engine_args import TOOL_CALL_PARSER_CHOICES

    assert set(TOOL_CALL_PARSER_CHOICES) == set(TOOL_CALL_PARSERS)
