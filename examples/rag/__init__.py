"""Retrieval-augmented generation against two compiled-engine servers: docs/rag.md."""
