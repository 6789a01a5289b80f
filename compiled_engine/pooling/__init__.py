"""Embedding (pooling) models: a model body run prefill-only, its hidden states pooled per input.

The options' records live at the top of the package (`pooler_config.py`, `pooling_params.py`, as
`sampling_params.py`); docs/embeddings.md has the whole story.
"""
