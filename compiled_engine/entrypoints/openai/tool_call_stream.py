"""One chat choice of a request with tools, streamed: content deltas and OpenAI tool-call deltas.

A named function streams its arguments as they are generated (the whole reply is the arguments);
"required" holds the reply (a JSON array) until it ends and then sends every call; "auto" streams
what is surely content and holds back from a possible call's opening tag, sending the calls at
the end.
"""

from __future__ import annotations

from compiled_engine.entrypoints.openai.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from compiled_engine.entrypoints.openai.structured_request import ToolPlan, new_call_id


class ToolCallStream:
    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.num_content_sent = 0
        self.has_tool_calls = plan.mode == "named"
        self._named_started = False

    def feed(self, new_text: str) -> DeltaMessage | None:
        """What of `new_text` (the choice's newest text) can be sent now."""
        self.text += new_text
        if self.plan.mode == "named":
            assert self.plan.tool is not None
            if not self._named_started:
                self._named_started = True
                call = DeltaToolCall(
                    index=0,
                    id=new_call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=self.plan.tool.name, arguments=new_text),
                )
                return DeltaMessage(tool_calls=[call])
            if not new_text:
                return None
            return DeltaMessage(
                tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new_text))]
            )
        if self.plan.mode == "required":
            return None
        assert self.plan.parser is not None
        end = self.plan.parser.content_prefix_length(self.text)
        if end <= self.num_content_sent:
            return None
        content = self.text[self.num_content_sent : end]
        self.num_content_sent = end
        return DeltaMessage(content=content)

    def finish(self) -> DeltaMessage | None:
        """The rest once the choice ended: held-back content and the calls."""
        if self.plan.mode == "named":
            return None
        parsed = self.plan.parse(self.text)
        if not parsed.tool_calls:
            rest = self.text[self.num_content_sent :]
            return DeltaMessage(content=rest) if rest else None
        self.has_tool_calls = True
        rest = ""
        if self.plan.mode == "auto":
            assert self.plan.parser is not None
            rest = self.text[self.num_content_sent : self.plan.parser.content_prefix_length(self.text)]
        calls = [
            DeltaToolCall(
                index=i,
                id=new_call_id(),
                type="function",
                function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
            )
            for i, call in enumerate(parsed.tool_calls)
        ]
        return DeltaMessage(content=rest or None, tool_calls=calls)
