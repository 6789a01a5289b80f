"""Where the default model that ships inside the package lives.

The folder is package data (see pyproject.toml), so it is found the same way from a source
checkout, an editable install and a wheel. `scripts/train_default_model.py` writes it; see
docs/default-model.md for how it was trained.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_MODEL_PACKAGE_DIR = "default_model"
DEFAULT_DRAFT_PACKAGE_DIR = "default_model_draft"


def default_model_dir() -> Path:
    """The shipped Hugging Face folder (config, bf16 safetensors, tokenizer with chat template)."""
    return _package_folder(DEFAULT_MODEL_PACKAGE_DIR, "the default model")


def default_draft_dir() -> Path:
    """The default model's draft for speculative decoding, a shipped Hugging Face folder:
    `speculative_config={"method": "draft_model", "model": str(default_draft_dir()), ...}`."""
    return _package_folder(DEFAULT_DRAFT_PACKAGE_DIR, "the default model's draft")


def _package_folder(name: str, what: str) -> Path:
    # A wheel or editable install unpacks package data as real files, so the Traversable is a path.
    folder = Path(str(resources.files("compiled_engine").joinpath(name)))
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{what} is missing from {folder}: the package was installed without its "
            "package data; reinstall compiled-engine, or pass a Hugging Face folder explicitly"
        )
    return folder
