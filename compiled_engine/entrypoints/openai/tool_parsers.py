"""Tool calls parsed out of a model's text (`tool_choice: "auto"`), one parser per chat format.

The server picks one with `--tool-call-parser` (vLLM's flag). A parser turns a finished reply into
its plain content and its calls, and, streaming, says how much of the text so far is surely
content (everything before a possible call's opening tag), so content streams while a call is
held back until the reply ends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # None when the reply is only calls
    tool_calls: tuple[ParsedToolCall, ...]


class ToolCallParser(Protocol):
    name: ClassVar[str]

    def parse(self, text: str) -> ParsedReply: ...

    def content_prefix_length(self, text: str) -> int:
        """How many leading characters of a reply still being generated are surely content."""
        ...


class HermesToolCallParser:
    """Hermes / Qwen style: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    after any plain content. A call whose JSON does not parse leaves the whole reply as content."""

    name: ClassVar[str] = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        start = text.find(self.OPEN)
        if start < 0:
            return ParsedReply(text, ())
        calls = []
        for body in self._CALL.findall(text[start:]):
            call = _call_from_json(body)
            if call is None:
                return ParsedReply(text, ())
            calls.append(call)
        content = text[:start].strip()
        return ParsedReply(content or None, tuple(calls))

    def content_prefix_length(self, text: str) -> int:
        start = text.find(self.OPEN)
        if start >= 0:
            return start
        # Hold back a tail that could be the tag's beginning ("<tool_", say).
        for keep in range(min(len(self.OPEN) - 1, len(text)), 0, -1):
            if self.OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def _call_from_json(body: str) -> ParsedToolCall | None:
    try:
        value: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedToolCall(value["name"], text)


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {HermesToolCallParser.name: HermesToolCallParser}


def tool_call_parser(name: str) -> ToolCallParser:
    try:
        return TOOL_CALL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_CALL_PARSERS)}"
        ) from None
