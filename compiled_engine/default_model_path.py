"""Where the default model that ships inside the package lives.

The folder is package data (see pyproject.toml), so it is found the same way from a source
checkout, an editable install and a wheel. `scripts/train_default_model.py` writes it; see
docs/default-model.md for how it was trained.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_MODEL_PACKAGE_DIR = "default_model"


def default_model_dir() -> Path:
    """The shipped Hugging Face folder (config, bf16 safetensors, tokenizer with chat template)."""
    # A wheel or editable install unpacks package data as real files, so the Traversable is a path.
    folder = Path(str(resources.files("compiled_engine").joinpath(DEFAULT_MODEL_PACKAGE_DIR)))
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"the default model is missing from {folder}: the package was installed without its "
            "package data; reinstall compiled-engine, or pass model=<Hugging Face folder> explicitly"
        )
    return folder
