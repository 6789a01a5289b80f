"""`/v1/embeddings` (OpenAI's format) and the app `compiled-engine serve` runs for a pooling model.

A pooling model is served by its own small app (`build_embedding_app`): /v1/embeddings, /v1/models
(each card says `"runner": "pooling"`), /health, /ready; the generation endpoints answer a clear 400.
The engine (`PoolingEngine`) runs in this process on one worker thread (`EmbeddingBatcher`):
requests that arrive while a batch runs are embedded together in the next one, packed into
varlen steps under the token budget. Each request's inputs are checked on their own first, so a
bad request fails alone and the rest of its batch is served.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import queue
import threading
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from compiled_engine.engine_args import DEFAULT_MAX_REQUEST_BYTES
from compiled_engine.entrypoints.openai.errors import bad_request
from compiled_engine.entrypoints.openai.middleware import add_request_guards
from compiled_engine.entrypoints.openai.protocol import ModelCard, OpenAIModel
from compiled_engine.entrypoints.openai.served_models import ServedModels
from compiled_engine.pooling.outputs import EmbeddingRequestOutput
from compiled_engine.pooling.pooling_engine import EmbedPrompt, PoolingEngine
from compiled_engine.pooling_params import PoolingParams


class EmbeddingRequest(OpenAIModel):
    model: str | None = None
    # A text, a list of texts, one input's token ids, or a list of inputs' token ids.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extension: embed the last this many tokens of a longer input instead of refusing it.
    truncate_prompt_tokens: int | None = None


class PoolingModelCard(ModelCard):
    runner: Literal["pooling"] = "pooling"


@dataclass
class _Job:
    prompts: list[EmbedPrompt]
    params: PoolingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class EmbeddingBatcher:
    """The engine on one thread: `await embed(...)` from any coroutine; concurrent requests batch."""

    def __init__(self, engine: PoolingEngine) -> None:
        self.engine = engine
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="embedding-engine", daemon=True)
        self._thread.start()

    async def embed(self, prompts: list[EmbedPrompt], params: PoolingParams) -> list[EmbeddingRequestOutput]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put(_Job(prompts, params, future, loop))
        return await future

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(60)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch = [job]
            with contextlib.suppress(queue.Empty):
                while True:
                    more = self._jobs.get_nowait()
                    if more is None:
                        self._jobs.put(None)  # stop after this batch
                        break
                    batch.append(more)
            self._run(batch)

    def _run(self, batch: list[_Job]) -> None:
        ready: list[tuple[_Job, list]] = []
        for job in batch:
            try:
                ready.append((job, self.engine.prepare(job.prompts, job.params)))
            except (ValueError, TypeError) as exc:
                _settle(job, exception=exc)
        if not ready:
            return
        try:
            outputs = self.engine.run([item for _, prepared in ready for item in prepared])
        except Exception as exc:
            for job, _ in ready:
                _settle(job, exception=exc)
            return
        start = 0
        for job, prepared in ready:
            _settle(job, result=outputs[start : start + len(prepared)])
            start += len(prepared)


def _settle(job: _Job, result=None, exception: BaseException | None = None) -> None:
    def settle() -> None:
        if job.future.done():  # the client left
            return
        if exception is not None:
            job.future.set_exception(exception)
        else:
            job.future.set_result(result)

    job.loop.call_soon_threadsafe(settle)


def _prompts(value: str | list[str] | list[int] | list[list[int]]) -> list[EmbedPrompt]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("'input' is empty: give a string, a list of strings or token ids", param="input")
    if all(isinstance(v, int) for v in value):
        return [cast("list[int]", value)]  # one input's token ids
    return cast("list[EmbedPrompt]", list(value))


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    # OpenAI's base64: the little-endian float32 bytes.
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


async def create_embedding(batcher: EmbeddingBatcher, models: ServedModels, body: EmbeddingRequest) -> dict:
    name = models.resolve(body.model)
    try:
        params = PoolingParams(dimensions=body.dimensions, truncate_prompt_tokens=body.truncate_prompt_tokens)
    except ValueError as exc:
        raise bad_request(str(exc), param="dimensions" if "dimensions" in str(exc) else None) from None
    prompts = _prompts(body.input)
    try:
        outputs = await batcher.embed(prompts, params)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param="dimensions" if "dimensions" in str(exc) else "input") from None
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encode(o.outputs.embedding, body.encoding_format),
            }
            for i, o in enumerate(outputs)
        ],
        "model": name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def build_embedding_app(
    engine: PoolingEngine,
    *,
    served_model_names: Sequence[str],
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The app serving a pooling model; its lifespan's end stops the engine thread."""
    from compiled_engine.entrypoints.openai.api_server import add_error_handlers, parse_body

    models = ServedModels(served_model_names, root=engine.model_dir, max_model_len=engine.max_model_len)
    batcher = EmbeddingBatcher(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(batcher.shutdown)

    app = FastAPI(title="compiled-engine (embeddings)", lifespan=lifespan)
    add_request_guards(app, max_request_bytes, api_key)
    add_error_handlers(app)

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready():
        return JSONResponse({"serving": True})

    @app.get("/v1/models")
    async def list_models():
        cards = [
            PoolingModelCard(id=name, root=engine.model_dir, max_model_len=engine.max_model_len)
            for name in models.names
        ]
        # Each card dumped as itself: a ModelList would drop the subclass's `runner`.
        return JSONResponse({"object": "list", "data": [card.model_dump() for card in cards]})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await parse_body(request, EmbeddingRequest)
        return JSONResponse(await create_embedding(batcher, models, body))

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def generation_on_a_pooling_model():
        raise bad_request(
            f"the model {models.default!r} is an embedding (pooling) model: it serves /v1/embeddings, "
            "not text generation"
        )

    return app
