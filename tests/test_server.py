"""The OpenAI-compatible server, driven over real HTTP by the official `openai` client.

A uvicorn server runs on 127.0.0.1 in a background thread around an AsyncLLM built here, so the
tests can also look at the engine directly (KV blocks free, per-request records). One test starts
`compiled-engine serve` as a subprocess and stops it with SIGTERM mid-stream.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from compiled_engine.engine.async_llm import AsyncLLM, FinishedRequestStats
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_args import EngineArgs
from compiled_engine.entrypoints.openai.api_server import build_app
from tests.test_async_llm import wait_until_idle

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 64 * 1024
ENGINE_OPTIONS = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True, num_kv_blocks=160)
# A minimal template: the tiny test tokenizer has none of its own.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "def add(a, b):"}]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


class FinishedRecorder:
    """Stats listener: what the engine thread reports for each finished request."""

    def __init__(self) -> None:
        self.finished: dict[str, FinishedRequestStats] = {}

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        pass

    def on_new_tokens(self, num_tokens: int, inter_token_s: float | None) -> None:
        pass

    def on_finished(self, stats: FinishedRequestStats) -> None:
        self.finished[stats.request_id] = stats


class ServerThread:
    """uvicorn serving `app` on a free 127.0.0.1 port, in a background thread."""

    def __init__(self, app) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def chat_model_dir(llama_dir, tmp_path_factory) -> str:
    target = tmp_path_factory.mktemp("chat-model") / "tiny-llama-chat"
    shutil.copytree(llama_dir, target)
    (target / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return str(target)


@pytest.fixture(scope="module")
def served(chat_model_dir):
    recorder = FinishedRecorder()
    engine_args = EngineArgs(model=chat_model_dir, **ENGINE_OPTIONS)
    engine = AsyncLLM(LLMEngine(engine_args), stats_listeners=[recorder])
    app = build_app(
        engine, served_model_names=[MODEL, "tiny-alias"], api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES
    )
    server = ServerThread(app)
    yield server, engine, recorder
    server.stop()  # the app's lifespan shuts the engine down
    assert not engine.is_running


@pytest.fixture
def client(served) -> openai.OpenAI:
    server, _, _ = served
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture
def tokenizer(served):
    return served[1].tokenizer


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _metrics(url: str) -> dict[str, float]:
    """/metrics as {sample name{labels}: value}, parsed by prometheus_client's own parser."""
    status, body = _get(f"{url}/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


# -- completions ------------------------------------------------------------------------------------------


def test_completion_text_usage_and_request_log(client, tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="compiled_engine.requests")
    prompt = "def add(a, b):"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
    assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
    (choice,) = resp.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    # Text-only round trip: the text re-tokenizes to something, and is what greedy gives again.
    again = client.completions.create(model="tiny-alias", prompt=prompt, max_tokens=8, **GREEDY)
    assert again.choices[0].text == choice.text and again.model == "tiny-alias"
    line = next(r.getMessage() for r in caplog.records if f"request_id={resp.id} " in r.getMessage())
    assert f"prompt_tokens={resp.usage.prompt_tokens} output_tokens=8 " in line
    assert "ttft_s=" in line and "total_s=" in line and "finish_reason=length" in line


def test_completion_stream_matches_the_whole_response(client, served):
    server, _, _ = served
    whole = client.completions.create(model=MODEL, prompt="class Stack:", max_tokens=12, **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="class Stack:",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.usage is None for c in text_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    # On the wire: server-sent events closed by `data: [DONE]`.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"model": MODEL, "prompt": "import os", "max_tokens": 4, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert all(json.loads(e[len("data: ") :])["object"] == "text_completion" for e in events[:-1])


def test_tokens_held_back_by_the_detokenizer_still_stream_one_chunk_each(client, tokenizer):
    # The lead byte of a 3-byte character, forced at every step: its text is never a whole
    # character, so the detokenizer holds it all back until the end. Each token still gets its
    # own chunk when it is made (empty text, as vLLM sends it); the text comes with the last.
    # Outputs that reach a request's stream while its reader is behind come out as one chunk
    # (engine/async_llm.py's RequestStream, as vLLM's output collector): on a loaded machine two
    # steps can land before the server's loop runs, so fewer, never more, empty chunks arrive.
    lead_byte = tokenizer.convert_tokens_to_ids("\u00e2")  # byte-level BPE's symbol for 0xE2
    assert tokenizer.decode([lead_byte]) == "\ufffd"
    params = dict(model=MODEL, max_tokens=6, logit_bias={str(lead_byte): 100}, **GREEDY)
    whole = client.completions.create(prompt="import os", **params)
    assert whole.usage.completion_tokens == 6 and whole.choices[0].text == "\ufffd" * 6
    chunks = [c for c in client.completions.create(prompt="import os", stream=True, **params) if c.choices]
    empty = len(chunks) - 1
    assert 1 <= empty <= 5
    assert [c.choices[0].text for c in chunks] == [""] * empty + [whole.choices[0].text]
    assert [c.choices[0].finish_reason for c in chunks] == [None] * empty + ["length"]
    chat = client.chat.completions.create(messages=MESSAGES, stream=True, **params)
    deltas = [c.choices[0] for c in chat if c.choices][1:]  # after the opening role chunk
    assert 1 <= len(deltas) - 1 <= 5
    assert [d.delta.content for d in deltas] == [""] * (len(deltas) - 1) + ["\ufffd" * 6]
    assert deltas[-1].finish_reason == "length"


def test_completion_n_seed_prompt_list_and_echo(client, tokenizer):
    params = dict(model=MODEL, max_tokens=5, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    resp = client.completions.create(prompt="import os", n=3, **params)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.text for c in resp.choices}) > 1  # n samples, not one copied
    assert resp.usage.completion_tokens == 15
    assert resp.usage.prompt_tokens == len(tokenizer("import os")["input_ids"])
    # Seeded: the same request gives the same samples, streamed or not.
    again = client.completions.create(prompt="import os", n=3, **params)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(prompt="import os", n=3, stream=True, **params):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in resp.choices]
    # A list of prompts: choices prompt-major, usage summed over prompts.
    batch = client.completions.create(prompt=["import os", "class Stack:"], n=2, echo=True, **params)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text.startswith("import os") and batch.choices[2].text.startswith("class Stack:")
    assert batch.usage.prompt_tokens == sum(
        len(tokenizer(p)["input_ids"]) for p in ("import os", "class Stack:")
    )
    assert batch.usage.completion_tokens == 20
    # Token-id prompts, one or several.
    ids = client.completions.create(prompt=[[5, 9, 11], [7, 8]], echo=True, **params)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    assert ids.choices[0].text.startswith(tokenizer.decode([5, 9, 11]))
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt=[5, 10**6], echo=True, **params)
    assert "vocabulary" in _error(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt=["import os", [5, 9, 11]], **params)  # mixed: not OpenAI's API
    assert _error(info.value)["param"] == "prompt"


def test_completion_stop_string_ends_the_text(client):
    full = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=24, **GREEDY)
    text = full.choices[0].text
    start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    resp = client.completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=24, stop=[stop], **GREEDY
    )
    assert resp.choices[0].text == text[: text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 24


def test_completion_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt="import os", max_tokens=6, logprobs=3, **GREEDY)
    logprobs = resp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert value == pytest.approx(max(top.values()))
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    # echo with logprobs: the prompt's tokens come first, the very first one without a logprob.
    echoed = client.completions.create(
        model=MODEL, prompt="import os", max_tokens=6, logprobs=1, echo=True, **GREEDY
    ).choices[0]
    num_prompt = len(echoed.logprobs.tokens) - 6
    assert echoed.text == "import os" + resp.choices[0].text and num_prompt >= 2
    assert echoed.logprobs.token_logprobs[0] is None
    assert all(v <= 0 for v in echoed.logprobs.token_logprobs[1:])
    assert echoed.logprobs.token_logprobs[num_prompt:] == pytest.approx(logprobs.token_logprobs)


def test_penalties_and_logit_bias_reach_the_sampler(client, tokenizer):
    forced = client.completions.create(
        model=MODEL, prompt="import os", max_tokens=5, logit_bias={"42": 100}, **GREEDY
    ).choices[0]
    assert forced.text == tokenizer.decode([42] * 5)
    # The same bias with a strong frequency penalty: 42 can no longer repeat five times.
    penalised = client.completions.create(
        model=MODEL,
        prompt="import os",
        max_tokens=5,
        logit_bias={"42": 3},
        frequency_penalty=2.0,
        presence_penalty=2.0,
        **GREEDY,
    ).choices[0]
    assert penalised.text != forced.text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", presence_penalty=5)
    assert _error(info.value)["param"] == "presence_penalty"


# -- chat -------------------------------------------------------------------------------------------------


def test_chat_uses_the_template_streamed_or_not(client, tokenizer):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, **GREEDY)
    (choice,) = resp.choices
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("assistant:")
    assert resp.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert resp.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.model_dump() == resp.usage.model_dump()


def test_chat_n_and_logprobs(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=4,
        n=2,
        seed=3,
        temperature=1.0,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)
    for choice in resp.choices:
        for entry in choice.logprobs.content:
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= -1e9
            assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
    no_logprobs = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert no_logprobs.choices[0].logprobs is None


# -- errors -----------------------------------------------------------------------------------------------


def test_bad_parameters_are_400_in_openai_format(client, served):
    server, engine, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    error = _error(info.value)
    assert error["type"] == "invalid_request_error" and error["param"] == "temperature"
    assert "temperature" in error["message"] and set(error) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0)
    assert _error(info.value)["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    assert _error(info.value)["param"] == "messages"
    status, body = _post(f"{server.url}/v1/completions", b"{not json", {"Authorization": f"Bearer {API_KEY}"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    # The engine keeps serving after refusals.
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1
    wait_until_idle(engine, timeout=15.0)


def test_too_long_prompts_are_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * (MAX_MODEL_LEN + 10), max_tokens=4)
    assert "max_model_len" in _error(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="def f(): pass\n" * 100, max_tokens=4)
    assert "max_model_len" in _error(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_MODEL_LEN)
    assert "max_model_len" in _error(info.value)["message"]


def test_missing_or_wrong_api_key_is_401(served):
    server, _, _ = served
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert _error(info.value)["code"] == "invalid_api_key"
    status, body = _post(f"{server.url}/v1/completions", b'{"prompt": "x"}', {})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    # Health and metrics stay open (probes and scrapers carry no key).
    assert _get(f"{server.url}/health")[0] == 200
    assert _get(f"{server.url}/metrics")[0] == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x")
    error = _error(info.value)
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)


def test_oversized_body_is_413(client):
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x" * (2 * MAX_REQUEST_BYTES), max_tokens=1)
    assert info.value.status_code == 413
    assert _error(info.value)["code"] == "request_too_large"


def test_models_and_health(client, served):
    server, _, _ = served
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "tiny-alias"]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    status, body = _get(f"{server.url}/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


# -- load, disconnects, metrics ---------------------------------------------------------------------------


def test_concurrent_streams_with_disconnects_free_every_block(served):
    server, engine, recorder = served
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    prompts = ["def add(a, b):", "import os", "class Stack:", "for i in range(10):"]

    async def one(i: int):
        leave_early = i % 4 == 0  # a quarter of the clients close their stream mid-way
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompts[i % len(prompts)],
            max_tokens=200 if leave_early else 24,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if leave_early and len(chunks) == 3:
                await stream.close()
                break
        return leave_early, chunks

    async def main():
        return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(main())
    stats = wait_until_idle(engine, timeout=15.0)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    for leave_early, chunks in results:
        request_id = chunks[0].id
        if leave_early:
            record = recorder.finished[request_id]
            assert record.finish_reason == "abort" and record.num_output_tokens < 200
        else:
            assert chunks[-1].usage.completion_tokens == 24
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            assert recorder.finished[request_id].finish_reason == "length"
    # Still healthy and serving; the metrics agree that nothing is left running.
    assert _get(f"{server.url}/health")[0] == 200
    sync_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    assert (
        sync_client.completions.create(
            model=MODEL, prompt="x = 1", max_tokens=3, **GREEDY
        ).usage.completion_tokens
        == 3
    )
    wait_until_idle(engine, timeout=15.0)
    metrics = _metrics(server.url)
    assert metrics["compiled_engine:kv_cache_usage_perc{}"] == 0.0
    assert metrics["compiled_engine:num_requests_running{}"] == 0.0


def test_a_client_leaving_a_non_streaming_request_aborts_it(served, caplog):
    caplog.set_level(logging.INFO, logger="compiled_engine.entrypoints.openai.api_server")
    server, engine, recorder = served
    before = set(recorder.finished)
    conn = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"model": MODEL, "prompt": "import os", "max_tokens": 240, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    conn.sendall(head.encode() + body)
    deadline = time.monotonic() + 15
    while engine.stats().num_running == 0:  # until the engine runs it
        assert time.monotonic() < deadline
        time.sleep(0.005)
    conn.close()
    wait_until_idle(engine, timeout=15.0)
    (new,) = (recorder.finished[r] for r in set(recorder.finished) - before)
    assert new.finish_reason == "abort" and new.num_output_tokens < 240
    deadline = time.monotonic() + 5
    while not any("client disconnected" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a clean cancel, not a 500


def test_metrics_parse_and_move_with_requests(client, served):
    server, engine, _ = served
    wait_until_idle(engine, timeout=15.0)
    before = _metrics(server.url)
    resp = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=7, **GREEDY)
    after = _metrics(server.url)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("compiled_engine:prompt_tokens_total{}") == resp.usage.prompt_tokens
    assert moved("compiled_engine:generation_tokens_total{}") == 7
    assert moved("compiled_engine:request_success_total{finished_reason=length}") == 1
    assert moved("compiled_engine:time_to_first_token_seconds_count{}") == 1
    assert moved("compiled_engine:inter_token_latency_seconds_count{}") == 6
    assert moved("compiled_engine:e2e_request_latency_seconds_count{}") == 1
    assert after["compiled_engine:num_kv_blocks{}"] == engine.stats().num_kv_blocks
    assert after["compiled_engine:engine_healthy{}"] == 1
    # The same long prompt again: its full blocks come from the prefix cache.
    client.completions.create(model=MODEL, prompt="def add(a, b):" * 8, max_tokens=2, **GREEDY)
    first = _metrics(server.url)
    client.completions.create(model=MODEL, prompt="def add(a, b):" * 8, max_tokens=2, **GREEDY)
    second = _metrics(server.url)
    hits = "compiled_engine:prefix_cache_hits_total{}"
    assert second[hits] - first[hits] >= 16  # at least one block of 16 tokens
    assert 0 < second["compiled_engine:prefix_cache_hit_rate{}"] <= 1


# -- a model without a chat template; a dead engine -------------------------------------------------------


@pytest.fixture
def plain_server(llama_dir):
    engine = AsyncLLM(LLMEngine(EngineArgs(model=llama_dir, **ENGINE_OPTIONS)))
    server = ServerThread(build_app(engine, served_model_names=["plain"]))
    yield server, engine
    server.stop()


def test_chat_without_a_template_is_400_and_a_dead_engine_is_unhealthy(plain_server):
    server, engine = plain_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="plain", messages=MESSAGES)
    assert _error(info.value)["code"] == "no_chat_template"
    assert (
        client.completions.create(model="plain", prompt="import os", max_tokens=2).choices[0].text is not None
    )

    def broken_step():
        raise RuntimeError("device lost")

    engine._engine.step = broken_step
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="plain", prompt="import os", max_tokens=2)
    assert info.value.status_code == 503 and "device lost" in _error(info.value)["message"]
    status, body = _get(f"{server.url}/health")
    assert status == 503 and json.loads(body)["error"]["type"] == "engine_dead_error"
    assert _metrics(server.url)["compiled_engine:engine_healthy{}"] == 0


# -- the CLI, and SIGTERM -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_serve_drains_in_flight_streams_on_sigterm(chat_model_dir, tmp_path):
    port = _free_port()
    log_path = tmp_path / "serve.log"
    command = [
        sys.executable, "-m", "compiled_engine.entrypoints.cli", "serve", "--model", chat_model_dir,
        "--port", str(port), "--served-model-name", MODEL, "--enforce-eager", "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64",
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent
        )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=MODEL,
            prompt="import os",
            max_tokens=120,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)
        chunks.extend(stream)  # the stream runs to its end
        assert chunks[-1].usage.completion_tokens == 120
        # uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM
        # (what systemd and Kubernetes expect of a clean stop).
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log_path.read_text()
    assert f"request_id={chunks[0].id} " in output and "output_tokens=120" in output
    assert "Application shutdown complete" in output  # the lifespan ran: the engine was shut down


def test_embeddings_on_a_generation_model_is_400(client):
    with pytest.raises(
        openai.BadRequestError, match="is a generation model: /v1/embeddings needs a pooling model"
    ):
        client.embeddings.create(model=MODEL, input="x")
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1
