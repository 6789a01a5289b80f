"""Session-wide fixtures: tiny random models saved once, shared by every test that needs one."""

from __future__ import annotations

import pytest

from tests.model_factory import make_tiny_model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model(root / arch, arch=arch)) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]
