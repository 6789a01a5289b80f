"""Other inference engines timed on the same workloads as ours: vLLM (CPU build) and llama.cpp.

Each peer runs out of process, in its own environment: vLLM in a venv of its own (its runner,
vllm_runner.py, is executed by that venv's interpreter), llama.cpp as its own binaries. Nothing
here imports either, so the bench suites and the default tests run without them.
`pytest bench/ --peer vllm=PYTHON --peer llamacpp=DIR` adds their columns (bench/conftest.py).
"""
