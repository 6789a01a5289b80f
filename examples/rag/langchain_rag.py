"""RAG with LangChain over two compiled-engine servers: `OpenAIEmbeddings` against the embedding
server fills an in-memory vector store, `ChatOpenAI` against the chat server answers from what it
retrieves.

    python -m examples.rag.langchain_rag --embed-url http://127.0.0.1:8001/v1 \\
        --chat-url http://127.0.0.1:8000/v1 "Why are some tides larger than others?"
"""

from __future__ import annotations

from pathlib import Path

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_openai import ChatOpenAI, OpenAIEmbeddings

from examples.rag.common import RagAnswer, parse_args, print_answer, served_model, text_files

PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question using only the context below.\n\nContext:\n{context}"),
        ("human", "{question}"),
    ]
)


def load_documents(folder: Path) -> list[Document]:
    """One document per .txt file (the files are short, so no splitting); its id is the file name."""
    return [
        Document(
            id=path.name,
            page_content=path.read_text(encoding="utf-8").strip(),
            metadata={"source": path.name},
        )
        for path in text_files(folder)
    ]


def embeddings_client(embed_url: str, api_key: str) -> OpenAIEmbeddings:
    return OpenAIEmbeddings(
        model=served_model(embed_url, api_key).name,
        base_url=embed_url,
        api_key=api_key,
        # Send the text itself: otherwise the client first tokenizes with tiktoken (OpenAI's
        # tokenizer, not the served model's), which also needs its encodings downloaded.
        check_embedding_ctx_length=False,
    )


def build_vector_store(embed_url: str, api_key: str, docs_dir: Path) -> InMemoryVectorStore:
    """Embeds every document on the embedding server (one request per 1000 texts)."""
    store = InMemoryVectorStore(embeddings_client(embed_url, api_key))
    store.add_documents(load_documents(docs_dir))
    return store


def format_context(documents: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in documents)


def ask(
    store: InMemoryVectorStore,
    chat_url: str,
    api_key: str,
    question: str,
    *,
    top_k: int = 2,
    max_tokens: int = 64,
) -> RagAnswer:
    """Retrieves the `top_k` closest documents and has the chat server answer from them."""
    hits = store.as_retriever(search_kwargs={"k": top_k}).invoke(question)
    llm = ChatOpenAI(
        model=served_model(chat_url, api_key).name,
        base_url=chat_url,
        api_key=api_key,
        temperature=0,
        max_tokens=max_tokens,
    )
    chain = PROMPT | llm | StrOutputParser()
    answer = chain.invoke({"context": format_context(hits), "question": question})
    return RagAnswer(
        question=question,
        answer=answer,
        sources=[doc.metadata["source"] for doc in hits],
        contexts=[doc.page_content for doc in hits],
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args("RAG with LangChain over compiled-engine servers", argv)
    store = build_vector_store(args.embed_url, args.api_key, args.docs)
    print_answer(
        ask(store, args.chat_url, args.api_key, args.question, top_k=args.top_k, max_tokens=args.max_tokens)
    )


if __name__ == "__main__":
    main()
