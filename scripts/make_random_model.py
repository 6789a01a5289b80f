"""Write a tiny random-weight Llama folder (config, safetensors, tokenizer) for a first run.

Usage: python scripts/make_random_model.py OUT_DIR
The weights are random, so the text is too: this only shows the engine end to end offline.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.model_factory import make_tiny_model  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1]).resolve()
    if (out / "config.json").exists():
        print(f"{out} already holds a model; keeping it")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        print(make_tiny_model(out.parent, arch="llama", name=out.name))
