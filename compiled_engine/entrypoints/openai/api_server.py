"""The OpenAI-compatible server: `build_app()` (FastAPI) around an `AsyncLLM`, and `run_server()`,
what `compiled-engine serve` runs (uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /ready,
GET /metrics (POST /v1/embeddings: a 400 here; a pooling model gets serving_embeddings.py's app).
Errors use OpenAI's JSON shape (errors.py). Shutdown: on SIGTERM or Ctrl-C uvicorn stops accepting
connections and lets every response in flight (streams included) finish, then the app's lifespan
ends and the engine shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Sequence
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from compiled_engine.engine.async_llm import AsyncLLM
from compiled_engine.engine.data_parallel import DataParallelAsyncLLM, replica_args, replica_starter
from compiled_engine.engine.startup_heap import freeze_startup_heap
from compiled_engine.engine_args import DEFAULT_MAX_REQUEST_BYTES, ServerArgs
from compiled_engine.entrypoints.openai.errors import OpenAIError, bad_request, error_response
from compiled_engine.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from compiled_engine.entrypoints.openai.middleware import add_request_guards
from compiled_engine.entrypoints.openai.prompt_tokenizer import PromptTokenizer
from compiled_engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from compiled_engine.entrypoints.openai.served_models import ServedModels
from compiled_engine.entrypoints.openai.serving_chat import OpenAIServingChat
from compiled_engine.entrypoints.openai.serving_completions import OpenAIServingCompletion
from compiled_engine.entrypoints.openai.tool_parsers import tool_call_parser as tool_call_parser_named

logger = logging.getLogger(__name__)


def build_app(
    engine: AsyncLLM,
    *,
    served_model_names: Sequence[str],
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    shutdown_engine_on_exit: bool = True,
    tool_call_parser: str = "hermes",
) -> FastAPI:
    """The app serving `engine`. With `shutdown_engine_on_exit`, the app's lifespan end (server
    shutdown) shuts the engine down too."""
    models = ServedModels(served_model_names, root=engine.model_dir, max_model_len=engine.max_model_len)
    tokenizer = PromptTokenizer(engine.tokenizer)
    metrics = ServerMetrics(engine, models.default)
    engine.add_stats_listener(metrics)
    completions = OpenAIServingCompletion(engine, models, tokenizer)
    chat = OpenAIServingChat(engine, models, tokenizer, tool_parser=tool_call_parser_named(tool_call_parser))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        tokenizer.close()
        if shutdown_engine_on_exit:
            # shutdown() joins the engine thread: keep the event loop free meanwhile.
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="compiled-engine", lifespan=lifespan)
    add_request_guards(app, max_request_bytes, api_key)
    add_error_handlers(app)

    @app.get("/health")
    async def health():
        if engine.errored:
            return error_response(
                HTTPStatus.SERVICE_UNAVAILABLE, "the engine loop failed", type="engine_dead_error"
            )
        if not engine.is_running:
            return error_response(
                HTTPStatus.SERVICE_UNAVAILABLE, "the engine is shut down", type="service_unavailable"
            )
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready():
        """Serving (requests are accepted), and how many compiled graphs are ready, compiling,
        failed: with the background compile policy the engine serves before all are built."""
        graphs = engine.graph_status()
        return JSONResponse({"serving": engine.is_running and not engine.errored, "graphs": graphs.to_json()})

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(models.model_list().model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        body = await parse_body(request, CompletionRequest)
        return await _unless_disconnected(request, completions.create(body), streaming=body.stream)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        return await _unless_disconnected(request, chat.create(body), streaming=body.stream)

    @app.post("/v1/embeddings")
    async def embeddings_on_a_generation_model():
        raise bad_request(
            f"the model {models.default!r} is a generation model: /v1/embeddings needs a pooling model "
            "(serve a sentence-transformers folder, or --runner pooling)"
        )

    return app


async def parse_body(request: Request, model: type[BaseModel]):
    """The body as `model`; malformed JSON or fields are a 400 naming the first bad field."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        if not errors[0].get("loc"):  # not JSON, or not an object
            raise bad_request(f"the request body is not a valid JSON object: {errors[0]['msg']}") from None
        field = str(errors[0]["loc"][0])
        # A field with a union type fails once per alternative: report them together.
        problems = [
            ".".join(str(part) for part in e["loc"][1:]) + f" {e['msg']}"
            for e in errors
            if e["loc"] and str(e["loc"][0]) == field
        ]
        raise bad_request(
            f"invalid '{field}': " + "; ".join(p.strip() for p in problems[:4]), param=field
        ) from None


async def _unless_disconnected(request: Request, handler, streaming: bool):
    """Run a handler, cancelling it if the client disconnects first.

    A non-streaming request sends nothing until its reply is complete, so nothing else would notice
    a client that left: the handler's cancellation aborts its engine requests. (A streaming
    handler returns as soon as its requests are queued; from then on its response watches.)
    """
    if streaming:
        return await handler
    handler_task = asyncio.ensure_future(handler)
    disconnect_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({handler_task, disconnect_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect_task.cancel()
        if not handler_task.done():
            handler_task.cancel()
    if handler_task in done:
        return handler_task.result()
    # The client left first. Wait for the cancelled handler to unwind (its engine requests are
    # aborted on the way out); nobody reads the response, the connection is gone.
    with contextlib.suppress(asyncio.CancelledError):
        await handler_task
    logger.info("client disconnected before its response was ready; request aborted")
    return Response(status_code=499)


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read: the next message is the disconnect (or the reply is sent first).
    while (await request.receive())["type"] != "http.disconnect":
        pass


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == HTTPStatus.NOT_FOUND else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type=kind)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        logger.exception("unhandled error while serving a request", exc_info=exc)
        return error_response(
            HTTPStatus.INTERNAL_SERVER_ERROR, f"internal server error: {exc!r}", type="internal_server_error"
        )


# -- compiled-engine serve ---------------------------------------------------------------------------------


def run_server(args: ServerArgs) -> int:
    """Bind first (a taken port fails before minutes of model loading), build the engine, serve
    until SIGTERM/SIGINT, drain, exit."""
    import uvicorn

    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(f"compiled-engine: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("compiled_engine.requests").setLevel(logging.INFO)
    names = args.served_model_names()
    if args.resolve_runner() == "pooling":
        return _serve_pooling_model(args, sock, names)
    # The engine (and its workers) get the engine's options only: never the API key. It runs in a
    # process of its own, so its steps never hold this process's GIL (engine/process_async_llm.py).
    engine_args = args.engine_args()
    engine: AsyncLLM
    if engine_args.data_parallel_size > 1:
        engine = DataParallelAsyncLLM.start(engine_args)
    else:  # one engine: a local process, or a Ray actor
        engine = replica_starter(replica_args(engine_args, 1), engine_args.distributed_executor_backend)()
    app = build_app(
        engine,
        served_model_names=names,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        tool_call_parser=args.tool_call_parser,
    )
    config = uvicorn.Config(app, log_level="info", timeout_keep_alive=5)
    server = uvicorn.Server(config)
    freeze_startup_heap()  # no collector pass over the start-up heap mid-stream
    print(
        f"compiled-engine: serving {', '.join(names)} on http://{args.host}:{sock.getsockname()[1]}",
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    return 0 if not engine.errored else 1


def _serve_pooling_model(args: ServerArgs, sock: socket.socket, names: Sequence[str]) -> int:
    """An embedding model: its engine in this process, its own app (serving_embeddings.py)."""
    import uvicorn

    from compiled_engine.entrypoints.openai.serving_embeddings import build_embedding_app
    from compiled_engine.pooling.pooling_engine import PoolingEngine

    app = build_embedding_app(
        PoolingEngine(args.engine_args()),
        served_model_names=names,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_keep_alive=5))
    freeze_startup_heap()
    print(
        f"compiled-engine: serving {', '.join(names)} (embeddings) on "
        f"http://{args.host}:{sock.getsockname()[1]}",
        flush=True,
    )
    server.run(sockets=[sock])
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
