"""`/v1/embeddings` on a real server (uvicorn on 127.0.0.1) with the official `openai` client.

The pooling model is a tiny random sentence-transformers folder (tests/embedding_models.py); the
answers are compared with `SentenceTransformer.encode` on the same texts.
"""

from __future__ import annotations

import threading

import numpy as np
import openai
import pytest
import torch

from compiled_engine.entrypoints.openai.serving_embeddings import build_embedding_app
from compiled_engine.pooling.pooling_engine import PoolingEngine
from tests.embedding_models import TEXTS
from tests.test_embeddings import assert_parity, reference
from tests.test_server import ServerThread

MODEL = "tiny-embed"
API_KEY = "embed-key"


@pytest.fixture
def folder(st_qwen3_folder):
    return st_qwen3_folder


@pytest.fixture(scope="module")
def server(st_qwen3_llm):
    # The engine the embedding tests use (tests/conftest.py): its graphs are traced once.
    engine = st_qwen3_llm.engine
    assert isinstance(engine, PoolingEngine)
    thread = ServerThread(build_embedding_app(engine, served_model_names=[MODEL], api_key=API_KEY))
    yield thread
    thread.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _vectors(response) -> torch.Tensor:
    return torch.tensor([item.embedding for item in sorted(response.data, key=lambda d: d.index)])


def test_float_and_base64_match_sentence_transformers(client, folder):
    want = reference(folder, TEXTS)
    as_float = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert_parity(_vectors(as_float), want)
    # The client asks for base64 itself when no format is given, and decodes it.
    assert_parity(_vectors(client.embeddings.create(model=MODEL, input=TEXTS)), want)
    raw = client.embeddings.with_raw_response.create(model=MODEL, input="hello", encoding_format="base64")
    item = raw.http_response.json()["data"][0]
    decoded = np.frombuffer(__import__("base64").b64decode(item["embedding"]), dtype="<f4")
    assert_parity(torch.tensor(decoded)[None], want[:1])
    assert as_float.model == MODEL and as_float.object == "list"


def test_usage_token_ids_and_dimensions(client, folder, server):
    tokens = [len(ids) for ids in _token_ids(folder, TEXTS[:3])]
    response = client.embeddings.create(model=MODEL, input=TEXTS[:3], encoding_format="float")
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(tokens)
    ids = _token_ids(folder, TEXTS[:2])
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert_parity(_vectors(by_ids), _vectors(response)[:2])
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert_parity(_vectors(one), _vectors(response)[:1])
    short = client.embeddings.create(model=MODEL, input=TEXTS[:2], dimensions=16, encoding_format="float")
    assert _vectors(short).shape == (2, 16)
    torch.testing.assert_close(_vectors(short).norm(dim=-1), torch.ones(2))


def test_models_say_pooling_and_generation_is_400(client, server):
    cards = client.models.list().data
    assert [c.id for c in cards] == [MODEL] and cards[0].model_extra["runner"] == "pooling"
    with pytest.raises(openai.BadRequestError, match="is an embedding \\(pooling\\) model"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="is an embedding \\(pooling\\) model"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])


def test_bad_input_is_400_and_the_server_keeps_serving(client):
    cases = [
        ({"input": ""}, "the input is empty"),
        ({"input": []}, "'input' is empty"),
        ({"input": "def f(): pass\n" * 40}, "more than the model's 128; set truncate_prompt_tokens"),
        ({"input": "x", "dimensions": 65}, "dimensions=65 is more than the model gives"),
        ({"input": "x", "dimensions": 0}, "dimensions must be a positive int"),
        ({"input": [[1, 9999]]}, "not in the model's vocabulary"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            client.embeddings.create(model=MODEL, encoding_format="float", **kwargs)
    truncated = client.embeddings.create(
        model=MODEL,
        input="def f(): pass\n" * 40,
        encoding_format="float",
        extra_body={"truncate_prompt_tokens": 50},
    )
    assert truncated.usage.prompt_tokens == 50
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    assert len(client.embeddings.create(model=MODEL, input="x").data[0].embedding) == 64


def test_concurrent_requests_are_batched_and_each_gets_its_own(client, folder):
    want = reference(folder, TEXTS)
    results: dict[int, torch.Tensor] = {}

    def ask(i: int) -> None:
        results[i] = _vectors(client.embeddings.create(model=MODEL, input=TEXTS[i], encoding_format="float"))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(TEXTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert_parity(torch.cat([results[i] for i in range(len(TEXTS))]), want)


def _token_ids(folder, texts):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return [tokenizer(t)["input_ids"] for t in texts]
