"""What the LangChain and LlamaIndex examples share: the servers' model cards, the answer record,
and the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI

DOCS_DIR = Path(__file__).parent / "docs"
DEFAULT_QUESTION = "Why are some tides larger than others?"


@dataclass(frozen=True)
class ServedModel:
    """One card of a server's `/v1/models`: the name requests use and the context it takes."""

    name: str
    max_model_len: int


@dataclass(frozen=True)
class RagAnswer:
    """What a RAG query returns: the chat model's answer and the documents it was given."""

    question: str
    answer: str
    sources: list[str]  # file names of the retrieved documents, best match first
    contexts: list[str]  # the retrieved texts, in the same order


def served_model(base_url: str, api_key: str) -> ServedModel:
    """The first model a compiled-engine (or vLLM) server serves, read from its `/v1/models`."""
    card = OpenAI(base_url=base_url, api_key=api_key).models.list().data[0]
    # max_model_len is an extra field of vLLM's and our cards, not part of OpenAI's schema.
    return ServedModel(name=card.id, max_model_len=int((card.model_extra or {})["max_model_len"]))


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--embed-url", default="http://127.0.0.1:8001/v1", help="the embedding server")
    parser.add_argument("--chat-url", default="http://127.0.0.1:8000/v1", help="the chat server")
    parser.add_argument("--api-key", default="-", help="the servers' --api-key (any text if none)")
    parser.add_argument("--docs", type=Path, default=DOCS_DIR, help="a folder of .txt documents")
    parser.add_argument("--top-k", type=int, default=2, help="documents given to the chat model")
    parser.add_argument("--max-tokens", type=int, default=64, help="the answer's length limit")
    parser.add_argument("question", nargs="?", default=DEFAULT_QUESTION)
    args = parser.parse_args(argv)
    if not text_files(args.docs):
        parser.error(f"--docs {args.docs}: no .txt files there")
    return args


def text_files(folder: Path) -> list[Path]:
    """The documents: the folder's .txt files, in name order (none if it is not a folder)."""
    return sorted(folder.glob("*.txt")) if folder.is_dir() else []


def print_answer(result: RagAnswer) -> None:
    print(f"question: {result.question}")
    print(f"retrieved: {', '.join(result.sources)}")
    print(f"answer: {result.answer}")
