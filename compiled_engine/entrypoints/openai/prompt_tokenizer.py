"""Prompt → token ids for the server, on one worker thread beside the event loop.

The server tokenizes before it queues a request: usage reports the exact prompt length, chat's
default `max_tokens` is what the context has left, and the engine thread never spends a step's
time on a long prompt. One thread keeps long prompts off the event loop and keeps the server's
own tokenizer calls in order (fast tokenizers allow concurrent encode/decode, which the engine
thread's detokenizer does meanwhile, but not concurrent reconfiguration).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import jinja2

from compiled_engine.entrypoints.openai.errors import bad_request


class PromptTokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-tokenizer")

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    async def encode(self, text: str) -> list[int]:
        """A completion prompt, tokenized as the engine does (with the tokenizer's special tokens)."""
        self._require_tokenizer("prompt")
        if not text:
            raise bad_request("the prompt is empty", param="prompt")
        return await self._run(lambda: list(self.tokenizer.encode(text)))

    async def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> list[int]:
        """Messages rendered by the model's chat template, then tokenized (the template already
        holds whatever special tokens the model wants, so none are added)."""
        if not self.has_chat_template:
            raise bad_request(
                "this model has no chat template, so it cannot serve /v1/chat/completions; "
                "use /v1/completions with a plain prompt",
                param="messages",
                code="no_chat_template",
            )

        def render() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
            )
            return list(self.tokenizer.encode(text, add_special_tokens=False))

        try:
            return await self._run(render)
        except jinja2.TemplateError as exc:
            # Templates raise on conversations they do not accept (roles out of order, say).
            raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from exc

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _require_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer; send the prompt as token ids", param=param)

    async def _run(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
