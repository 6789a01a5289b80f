"""Session-wide fixtures: tiny random models saved once, shared by every test that needs one."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

# One Inductor cache for every compile in the session (and across runs on one machine): a cold
# compile costs 7-20 s here. Set before any test imports torch._inductor, which reads it.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"compiled-engine-tests-inductor-{os.getuid()}"),
)

# The engine's own compile cache (graphs/compile_cache.py): fresh per test session, so no test
# depends on what an earlier run left behind; tests that exercise the cache pass their own dir.
if "COMPILED_ENGINE_CACHE_DIR" not in os.environ:
    _session_cache = tempfile.mkdtemp(prefix="compiled-engine-tests-cache-")
    os.environ["COMPILED_ENGINE_CACHE_DIR"] = _session_cache
    atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)

# Steps build a missing graph on the request path ("blocking"), as the tests of compiled graphs
# expect; tests/test_background_compile.py and the others that exercise a policy pass it.
os.environ.setdefault("COMPILED_ENGINE_COMPILE_POLICY", "blocking")

import torch  # noqa: E402 - torch does not import triton

# Without CUDA, Triton kernels run under triton's interpreter. triton reads the flag when it is first
# imported (it jits its own tl.sum/tl.max then), so it must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.model_factory import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model(root / arch, arch=arch)) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def st_qwen3_folder(tmp_path_factory):
    """A tiny random Qwen3 sentence-transformers folder (last-token pooling, normalized)."""
    from tests.embedding_models import make_sentence_transformers_folder

    return make_sentence_transformers_folder(tmp_path_factory.mktemp("st"), "qwen3", "lasttoken")


@pytest.fixture(scope="session")
def st_qwen3_llm(st_qwen3_folder):
    """An eager pooling LLM on st_qwen3_folder, shared by the embedding and embedding-server tests
    (its graphs are traced once). runner "auto": the folder's modules.json makes it a pooling model."""
    from compiled_engine import LLM
    from tests.embedding_models import PACKED

    return LLM(model=str(st_qwen3_folder), device="cpu", enforce_eager=True, **PACKED)
