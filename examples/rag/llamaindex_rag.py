"""RAG with LlamaIndex over two compiled-engine servers: `OpenAILikeEmbedding` against the
embedding server builds a `VectorStoreIndex` of the documents, `OpenAILike` against the chat server
answers the query engine's prompt.

    python -m examples.rag.llamaindex_rag --embed-url http://127.0.0.1:8001/v1 \\
        --chat-url http://127.0.0.1:8000/v1 "Why are some tides larger than others?"
"""

from __future__ import annotations

from pathlib import Path

from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
from llama_index.embeddings.openai_like import OpenAILikeEmbedding
from llama_index.llms.openai_like import OpenAILike

from examples.rag.common import RagAnswer, parse_args, print_answer, served_model


def embedding_model(embed_url: str, api_key: str) -> OpenAILikeEmbedding:
    return OpenAILikeEmbedding(
        model_name=served_model(embed_url, api_key).name, api_base=embed_url, api_key=api_key
    )


def build_index(embed_url: str, api_key: str, docs_dir: Path) -> VectorStoreIndex:
    """Reads the folder's .txt files and embeds their nodes on the embedding server.

    The embedding model is passed in, not set in llama_index's global `Settings`, whose default is
    OpenAI's own service.
    """
    documents = SimpleDirectoryReader(str(docs_dir), required_exts=[".txt"]).load_data()
    return VectorStoreIndex.from_documents(documents, embed_model=embedding_model(embed_url, api_key))


def chat_model(chat_url: str, api_key: str, max_tokens: int) -> OpenAILike:
    chat = served_model(chat_url, api_key)
    return OpenAILike(
        model=chat.name,
        api_base=chat_url,
        api_key=api_key,
        is_chat_model=True,  # the query goes to /v1/chat/completions, through the model's template
        # The prompt helper fits the retrieved text into this window (counting with its own
        # tokenizer, not the model's); the server refuses a prompt longer than its max_model_len.
        context_window=chat.max_model_len,
        max_tokens=max_tokens,
        temperature=0,
    )


def ask(
    index: VectorStoreIndex,
    chat_url: str,
    api_key: str,
    question: str,
    *,
    top_k: int = 2,
    max_tokens: int = 64,
) -> RagAnswer:
    """Retrieves the `top_k` closest nodes and has the chat server answer from them."""
    engine = index.as_query_engine(llm=chat_model(chat_url, api_key, max_tokens), similarity_top_k=top_k)
    response = engine.query(question)
    return RagAnswer(
        question=question,
        answer=str(response.response),
        sources=[hit.node.metadata["file_name"] for hit in response.source_nodes],
        contexts=[hit.node.get_content() for hit in response.source_nodes],
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args("RAG with LlamaIndex over compiled-engine servers", argv)
    index = build_index(args.embed_url, args.api_key, args.docs)
    print_answer(
        ask(index, args.chat_url, args.api_key, args.question, top_k=args.top_k, max_tokens=args.max_tokens)
    )


if __name__ == "__main__":
    main()
