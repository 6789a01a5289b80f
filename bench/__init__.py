"""Latency and throughput suites (pytest-benchmark): our engine and Hugging Face side by side.

Run `pytest bench/ --benchmark-json=RESULTS.json`, then `python -m bench.report RESULTS.json`.
"""
