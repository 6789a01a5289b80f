"""The measuring client's own cost per request (#18): why bench/test_cold_start_serving.py sends its
token-id prompts through `extra_body`.

    python -m pytest bench/test_client_prompt.py -q -p no:cacheprovider --benchmark-columns=median,min,rounds

The cold-serving bench records every stream's chunks on one asyncio loop, the same loop that sends
each arriving request, so whatever the official `openai` client spends building a request is added
to the gaps the running streams record. This times `AsyncOpenAI.completions.create(..., stream=True)`
plus reading its one-chunk answer, for a 384-token-id prompt passed as `prompt` (the client walks the
list before sending) and as `extra_body={"prompt": ids}` (sent as given; the JSON body is the same),
with a 16-id and a text prompt beside them. No server: the answer comes from an
`httpx.MockTransport`, so the figure is the client library's alone (a real server's time would only
blur it); the test checks that both forms send the same prompt.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest

ROUNDS = {"full": 20, "quick": 5, "smoke": 1}
CALLS = {"full": 50, "quick": 20, "smoke": 2}
ANSWER = (
    b'data: {"id":"c","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\ndata: [DONE]\n\n'
)
IDS_384 = [random.Random(0).randrange(4000) for _ in range(384)]
PROMPTS = {
    "ids-384-as-prompt": (IDS_384, False),
    "ids-384-in-extra-body": (IDS_384, True),
    "ids-16-as-prompt": ([random.Random(1).randrange(4000) for _ in range(16)], False),
    "text-as-prompt": ("def add(a, b):\n    return a + b\n" * 12, False),
}


def _client(sent: list) -> openai.AsyncOpenAI:
    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["prompt"])
        return httpx.Response(200, content=ANSWER, headers={"content-type": "text/event-stream"})

    transport = httpx.MockTransport(answer)
    return openai.AsyncOpenAI(
        base_url="http://client-cost/v1", api_key="unused", max_retries=0,
        http_client=httpx.AsyncClient(transport=transport),
    )  # fmt: skip


async def _requests(client: openai.AsyncOpenAI, prompt, in_extra_body: bool, times: int) -> None:
    for _ in range(times):
        stream = await client.completions.create(
            model="m",
            prompt="" if in_extra_body else prompt,
            max_tokens=8,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **({"prompt": prompt} if in_extra_body else {})},
        )
        async for _ in stream:
            pass


@pytest.mark.parametrize("form", list(PROMPTS))
def test_client_request_cost(benchmark, request, form):
    profile = request.config._bench_sizes.profile
    prompt, in_extra_body = PROMPTS[form]
    sent: list = []
    client = _client(sent)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_requests(client, prompt, in_extra_body, 1))
        assert sent == [prompt]  # the server would get the prompt as given, either way
        benchmark.group = "openai client: one streaming completion request, no server"
        benchmark.extra_info.update(form=form, calls_per_round=CALLS[profile])
        benchmark.pedantic(
            lambda: loop.run_until_complete(_requests(client, prompt, in_extra_body, CALLS[profile])),
            rounds=ROUNDS[profile],
            warmup_rounds=1,
        )
    finally:
        loop.run_until_complete(client.close())
        loop.close()
