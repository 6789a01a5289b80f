"""The RAG examples (examples/rag/, docs/rag.md) end to end against two real servers on 127.0.0.1.

The embedding server serves a tiny random sentence-transformers folder (tests/embedding_models.py),
the chat server the embedded default model; both are the apps `compiled-engine serve` builds, run
by uvicorn in this process, shared by the LangChain and the LlamaIndex example.

Random weights make retrieval meaningless as semantics, so the tests assert what holds anyway: the
vectors a framework stored are sentence-transformers' own for the text the framework sent; a query
equal to a document's embedded text retrieves that document first (identical text, identical
vector, cosine 1); the answer is what the chat server generates for the prompt the framework built.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import openai
import pytest
import torch

from compiled_engine.engine.async_llm import AsyncLLM
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_args import EngineArgs
from compiled_engine.entrypoints.openai.api_server import build_app
from compiled_engine.entrypoints.openai.serving_embeddings import build_embedding_app
from compiled_engine.pooling.pooling_engine import PoolingEngine
from examples.rag.common import DOCS_DIR
from tests.test_embeddings import assert_parity, reference
from tests.test_server import ServerThread, _free_port, _get

API_KEY = "rag-key"
EMBED_MODEL, CHAT_MODEL = "tiny-embed", "chat"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def servers(st_qwen3_folder):
    """(embedding server URL, chat server URL): the pair every example here talks to."""
    # max_model_len 512: LlamaIndex embeds a document with its file path in front.
    pooling = PoolingEngine(
        EngineArgs(model=str(st_qwen3_folder), device="cpu", enforce_eager=True, max_model_len=512)
    )
    embed = ServerThread(build_embedding_app(pooling, served_model_names=[EMBED_MODEL], api_key=API_KEY))
    # The embedded default model (no --model): it has a chat template and a 1024-token context.
    chat_engine = AsyncLLM(LLMEngine(EngineArgs(device="cpu", enforce_eager=True, num_kv_blocks=256)))
    chat = ServerThread(build_app(chat_engine, served_model_names=[CHAT_MODEL], api_key=API_KEY))
    yield f"{embed.url}/v1", f"{chat.url}/v1"
    chat.stop()
    embed.stop()


@pytest.fixture(scope="module")
def chat_client(servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=servers[1], api_key=API_KEY, max_retries=0, timeout=120)


def _regenerate(chat_client: openai.OpenAI, messages: list[dict[str, str]]) -> str:
    """What the chat server answers to `messages` at temperature 0 (the examples' setting)."""
    response = chat_client.chat.completions.create(
        model=CHAT_MODEL,
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    assert response.usage is not None and response.usage.completion_tokens > 0
    return response.choices[0].message.content or ""


def test_langchain_rag(servers, chat_client, st_qwen3_folder):
    from examples.rag.langchain_rag import PROMPT, ask, build_vector_store, format_context, load_documents

    embed_url, chat_url = servers
    documents = load_documents(DOCS_DIR)
    assert len(documents) == 5
    store = build_vector_store(embed_url, API_KEY, DOCS_DIR)

    # OpenAIEmbeddings got (and decoded) sentence-transformers' own vectors for each document.
    stored = torch.tensor([store.store[doc.id]["vector"] for doc in documents])
    assert_parity(stored, reference(st_qwen3_folder, [doc.page_content for doc in documents]))

    retriever = store.as_retriever(search_kwargs={"k": 1})
    for doc in documents:
        assert [hit.id for hit in retriever.invoke(doc.page_content)] == [doc.id]

    target = documents[2]
    result = ask(store, chat_url, API_KEY, target.page_content, top_k=2, max_tokens=MAX_TOKENS)
    assert result.sources[0] == target.metadata["source"] and len(result.sources) == 2
    assert result.contexts[0] == target.page_content
    # The answer is the chat server's greedy continuation of exactly the prompt the chain built.
    hits = [next(d for d in documents if d.metadata["source"] == name) for name in result.sources]
    prompt = PROMPT.format_messages(context=format_context(hits), question=target.page_content)
    roles = {"system": "system", "human": "user"}
    messages = [{"role": roles[m.type], "content": str(m.content)} for m in prompt]
    assert result.answer and result.answer == _regenerate(chat_client, messages)


def test_llamaindex_rag(servers, chat_client, st_qwen3_folder):
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
    from llama_index.core.schema import MetadataMode

    from examples.rag.llamaindex_rag import ask, build_index

    embed_url, chat_url = servers
    index = build_index(embed_url, API_KEY, DOCS_DIR)
    nodes = list(index.docstore.docs.values())
    assert sorted(node.metadata["file_name"] for node in nodes) == sorted(
        p.name for p in DOCS_DIR.glob("*.txt")
    )

    # OpenAILikeEmbedding sends each node's embed-mode text with newlines made spaces; the index
    # holds sentence-transformers' own vectors for exactly that text.
    embedded_texts = [node.get_content(metadata_mode=MetadataMode.EMBED).replace("\n", " ") for node in nodes]
    stored = torch.tensor([index.vector_store.get(node.node_id) for node in nodes])
    assert_parity(stored, reference(st_qwen3_folder, embedded_texts))

    retriever = index.as_retriever(similarity_top_k=1)
    for node, text in zip(nodes, embedded_texts, strict=True):
        assert [hit.node.node_id for hit in retriever.retrieve(text)] == [node.node_id]

    class ChatRecorder(BaseEventHandler):
        """Keeps what LlamaIndex sent to the chat model and what came back."""

        events: list[LLMChatEndEvent] = []

        def handle(self, event, **kwargs) -> None:
            if isinstance(event, LLMChatEndEvent):
                self.events.append(event)

    recorder = ChatRecorder()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(recorder)
    try:
        target, question = nodes[1], embedded_texts[1]
        result = ask(index, chat_url, API_KEY, question, top_k=2, max_tokens=MAX_TOKENS)
    finally:
        dispatcher.event_handlers.remove(recorder)
    assert result.sources[0] == target.metadata["file_name"] and len(result.sources) == 2
    assert result.contexts[0] == target.get_content()
    [event] = recorder.events  # one chat call: the context fits the window in one prompt
    assert target.get_content() in str(event.messages[-1].content)
    messages = [{"role": m.role.value, "content": str(m.content)} for m in event.messages]
    assert event.response is not None
    raw = event.response.message.content or ""
    assert raw == _regenerate(chat_client, messages)
    assert result.answer and result.answer == raw


def test_a_docs_folder_without_text_files_is_a_usage_error(tmp_path, capsys):
    from examples.rag import langchain_rag, llamaindex_rag

    (tmp_path / "notes.md").write_text("not a .txt file")
    for main in (langchain_rag.main, llamaindex_rag.main):
        for folder in (tmp_path, tmp_path / "missing"):
            with pytest.raises(SystemExit) as exit_info:
                main(["--docs", str(folder)])  # refused before any server is asked
            assert exit_info.value.code == 2
            assert f"--docs {folder}: no .txt files there" in capsys.readouterr().err


# -- the commands docs/rag.md gives ------------------------------------------------------------------

ROOT = Path(__file__).parent.parent


@contextmanager
def _cli_server(args: list[str], log_path: Path):
    """`compiled-engine serve ARGS` in a subprocess on a free port; yields its /v1 URL."""
    port = _free_port()
    command = [sys.executable, "-m", "compiled_engine.entrypoints.cli", "serve", *args, "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_the_documented_commands(st_qwen3_folder, tmp_path):
    """Both servers started with `compiled-engine serve`, both examples run with `python -m`."""
    question = (DOCS_DIR / "tides.txt").read_text(encoding="utf-8").strip()
    names = {p.name for p in DOCS_DIR.glob("*.txt")}
    with ExitStack() as stack:
        common = ["--enforce-eager", "--api-key", API_KEY]
        embed_url = stack.enter_context(
            _cli_server(["--model", str(st_qwen3_folder), *common], tmp_path / "embed.log")
        )
        chat_url = stack.enter_context(_cli_server(common, tmp_path / "chat.log"))
        for module in ("examples.rag.langchain_rag", "examples.rag.llamaindex_rag"):
            run = subprocess.run(
                [sys.executable, "-m", module, "--embed-url", embed_url, "--chat-url", chat_url,
                 "--api-key", API_KEY, "--max-tokens", "8", question],
                cwd=ROOT, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert run.returncode == 0, run.stderr
            lines = run.stdout.splitlines()
            assert lines[0] == f"question: {question}"
            retrieved = lines[1].removeprefix("retrieved: ").split(", ")
            assert len(retrieved) == 2 and set(retrieved) <= names, lines[1]
            assert lines[2].startswith("answer: ")
            if module.endswith("langchain_rag"):  # it embeds the text alone: the same text is the top hit
                assert retrieved[0] == "tides.txt"
    assert "POST /v1/embeddings" in (tmp_path / "embed.log").read_text()
    assert "POST /v1/chat/completions" in (tmp_path / "chat.log").read_text()
