"""What a request asks the output to look like: `structured_outputs` (vLLM's extension, both
endpoints), chat's `response_format`, and chat's `tools` with `tool_choice` → one
`StructuredOutputsParams` (or none) and, for tools, how to read calls back out of the reply.

tool_choice "required" constrains the reply to a JSON array of calls of the given tools (name +
parameters matching that tool's schema) and a named function to that function's parameters, so
their calls always parse and validate; "auto" leaves the reply free and parses calls out of it
with the server's tool-call parser; "none" ignores the tools. Every problem is a 400 naming the
parameter.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from compiled_engine.entrypoints.openai.errors import bad_request
from compiled_engine.entrypoints.openai.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from compiled_engine.entrypoints.openai.tool_parsers import ParsedReply, ParsedToolCall, ToolCallParser
from compiled_engine.errors import InvalidRequestError
from compiled_engine.sampling_params import StructuredOutputsParams

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_EXTENSION_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def extension_constraint(raw: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` field → StructuredOutputsParams (400 on a bad one)."""
    if raw is None:
        return None
    unknown = sorted(set(raw) - set(_EXTENSION_KEYS))
    if unknown:
        raise bad_request(
            f"structured_outputs has unsupported key(s) {unknown}; use one of {list(_EXTENSION_KEYS)}",
            param="structured_outputs",
        )
    return checked(lambda: StructuredOutputsParams(**raw), "structured_outputs")


def checked(make, param: str) -> StructuredOutputsParams:
    """Build a constraint and parse its grammar now, so a bad one is a 400 naming `param`."""
    from compiled_engine.structured_output.constraint import build_grammar

    try:
        params = make()
        build_grammar(params)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=param) from None
    return params


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolPlan:
    """How the reply of a chat request with tools is read: "auto" (parsed by `parser`),
    "required" (a JSON array of calls) or "named" (the reply is `tool`'s arguments)."""

    mode: str
    parser: ToolCallParser | None = None
    tool: Tool | None = None

    def parse(self, text: str) -> ParsedReply:
        if self.mode == "named":
            assert self.tool is not None
            return ParsedReply(None, (ParsedToolCall(self.tool.name, text),))
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except ValueError:
                return ParsedReply(text, ())  # cut short by max_tokens: no call to report
            return ParsedReply(
                None,
                tuple(
                    ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls
                ),
            )
        assert self.parser is not None
        return self.parser.parse(text)


def chat_constraint(
    request: ChatCompletionRequest, parser: ToolCallParser
) -> tuple[StructuredOutputsParams | None, ToolPlan | None]:
    """The constraint of a chat request (from structured_outputs, response_format or tools)."""
    tools = _tools(request.tools)
    choice = _tool_choice(request.tool_choice, tools)
    plan: ToolPlan | None = None
    constraint: StructuredOutputsParams | None = None
    if choice == "auto":
        plan = ToolPlan("auto", parser=parser)
    elif choice == "required":
        plan = ToolPlan("required")
        constraint = checked(lambda: StructuredOutputsParams(json=_calls_schema(tools)), "tools")
    elif isinstance(choice, Tool):
        plan = ToolPlan("named", tool=choice)
        constraint = checked(lambda: StructuredOutputsParams(json=choice.parameters), "tools")
    for param, other in (
        ("response_format", _response_format_constraint(request.response_format)),
        ("structured_outputs", extension_constraint(request.structured_outputs)),
    ):
        if other is None:
            continue
        if constraint is not None:
            raise bad_request(
                f"{param} cannot be combined with tool_choice {request.tool_choice!r} "
                "(which constrains the reply itself)",
                param=param,
            )
        constraint = other
    return constraint, plan


def tool_calls(calls: tuple[ParsedToolCall, ...]) -> list[ToolCall]:
    return [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _response_format_constraint(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                'response_format of type "json_schema" needs json_schema.schema, a JSON schema object',
                param="response_format",
            )
        return checked(lambda: StructuredOutputsParams(json=schema), "response_format")
    raise bad_request(
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def _tools(raw: list[dict[str, Any]] | None) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(raw or ()):
        function = entry.get("function") if isinstance(entry, dict) else None
        if (
            not isinstance(entry, dict)
            or entry.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                param="tools",
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function has no name", param="tools")
        if name in tools:
            raise bad_request(f"tools[{i}]: a second tool named {name!r}", param="tools")
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        tools[name] = Tool(name, parameters)
    return tools


def _tool_choice(raw: str | dict[str, Any] | None, tools: dict[str, Tool]) -> str | Tool:
    if raw is None:
        return "auto" if tools else "none"
    if raw == "none":
        return "none"
    if raw in ("auto", "required"):
        if not tools:
            raise bad_request(f"tool_choice {raw!r} needs tools", param="tool_choice")
        return raw
    if isinstance(raw, dict):
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if raw.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}', param="tool_choice"
            )
        if name not in tools:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not among the tools "
                f"({sorted(tools) or 'none given'})",
                param="tool_choice",
            )
        return tools[name]
    raise bad_request(
        f'tool_choice must be "none", "auto", "required" or a named function, got {raw!r}',
        param="tool_choice",
    )


def _calls_schema(tools: dict[str, Tool]) -> dict[str, Any]:
    """A JSON array of one or more calls, each naming a tool and giving its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [tool.name]}, "parameters": tool.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools.values()
    ]
    return {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
