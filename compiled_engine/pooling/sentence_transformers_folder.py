"""Read a sentence-transformers model folder's pipeline: which modules, which pooling, normalized?

A folder `SentenceTransformer.save` wrote has `modules.json` listing its modules in order
(Transformer, Pooling, optionally Normalize; each with a `type` class path and a `path`), the
pooling settings in `<pooling path>/config.json` (this library's `pooling_mode` string, or older
versions' `pooling_mode_*_tokens` booleans) and the body's `max_seq_length` in
`sentence_bert_config.json`. Only what the engine runs is accepted: any other module (Dense,
a second pooling, ...) is an error naming it, never silently skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiled_engine.errors import ModelLoadError, UnsupportedModelError

MODULES_FILE = "modules.json"
BODY_CONFIG_FILE = "sentence_bert_config.json"

# sentence-transformers' pooling modes -> our pooling types.
_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}


@dataclass(frozen=True)
class SentenceTransformersPipeline:
    """What a folder's sentence-transformers files say (None: the folder does not say)."""

    pooling_type: str | None  # LAST / MEAN / CLS
    normalize: bool  # a Normalize module follows the pooling
    max_seq_length: int | None  # the body's input limit (sentence_bert_config.json)


def read_pipeline(model_dir: str | Path) -> SentenceTransformersPipeline | None:
    """The folder's pipeline, or None when it has no modules.json; errors name the file."""
    model_dir = Path(model_dir)
    path = model_dir / MODULES_FILE
    if not path.is_file():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelLoadError(f"{path} must hold a list of module objects")
    pooling_type: str | None = None
    normalize = False
    seen_body = False
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer" and not seen_body:
            seen_body = True
        elif kind == "Pooling" and pooling_type is None:
            pooling_type = _pooling_type(model_dir / str(module.get("path", "")) / "config.json")
        elif kind == "Normalize" and not normalize:
            normalize = True
        else:
            raise UnsupportedModelError(
                f"{path}: module {module.get('name')!r} of type {module.get('type')!r} is not supported; "
                "the engine runs Transformer, then Pooling, then optionally Normalize"
            )
    if not seen_body:
        raise UnsupportedModelError(f"{path} lists no Transformer module: there is no model body to run")
    return SentenceTransformersPipeline(
        pooling_type, normalize, _max_seq_length(model_dir / BODY_CONFIG_FILE)
    )


def _pooling_type(path: Path) -> str:
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    mode: Any = config.get("pooling_mode")
    if mode is None:
        active = [name for key, name in _LEGACY_MODE_KEYS.items() if config.get(key)]
        mode = active[0] if len(active) == 1 else active
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _MODES:
        raise UnsupportedModelError(
            f"{path}: pooling mode {mode!r} is not supported; the engine pools "
            f"{', '.join(sorted(_MODES))} (one mode)"
        )
    if config.get("include_prompt", True) is not True:
        raise UnsupportedModelError(
            f"{path}: include_prompt=false (pooling without the prompt) is not supported"
        )
    return _MODES[mode]


def _max_seq_length(path: Path) -> int | None:
    if not path.is_file():
        return None
    config = _read_json(path)
    value = config.get("max_seq_length") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
