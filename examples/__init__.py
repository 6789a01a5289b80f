"""Runnable examples of compiled-engine in applications (run from the repository root with `python -m`)."""
