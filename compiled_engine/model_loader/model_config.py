"""The few facts about a model that the engine needs, read once from its Hugging Face config.

Everything downstream (KV-cache sizing, the scheduler's stop checks, the attention op's per-layer
window) reads this record instead of poking at a transformers config, whose attribute names differ
between architectures and versions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

from compiled_engine.errors import ModelLoadError, UnsupportedModelError
from compiled_engine.records.weight_quantization import WeightQuantization

# The engine runs these weight dtypes; config.json spells them as strings.
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# The paged-attention op's convention for "no sliding window".
FULL_ATTENTION = -1


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the transformers class that runs it, e.g. "LlamaForCausalLM"
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    # One entry per layer: the window in tokens, or FULL_ATTENTION (-1).
    sliding_windows: tuple[int, ...]
    # The checkpoint's own weight quantization (config.json's quantization_config), None if it has none.
    quantization: WeightQuantization | None = None

    @classmethod
    def from_hf(
        cls,
        config,
        generation_config_path: str | Path | None = None,
        *,
        architecture: str | None = None,
        dtype: torch.dtype | None = None,
        quantization: WeightQuantization | None = None,
    ) -> ModelConfig:
        """Read a transformers `PretrainedConfig` (+ optional generation_config.json).

        `architecture` defaults to `config.architectures[0]`; `dtype` defaults to the config's own
        dtype (float32 when it names none) — pass the dtype the weights were actually loaded in.
        """
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = int(_required(text_config, "num_attention_heads"))
        hidden_size = int(_required(text_config, "hidden_size"))
        num_layers = int(_required(text_config, "num_hidden_layers"))
        head_dim = _optional(text_config, "head_dim") or hidden_size // num_heads
        num_kv_heads = _optional(text_config, "num_key_value_heads") or num_heads

        if architecture is None:
            named = getattr(config, "architectures", None)
            architecture = named[0] if named else _causal_lm_class_name(config)

        return cls(
            architecture=architecture,
            model_type=config.model_type,
            num_layers=num_layers,
            num_attention_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            hidden_size=hidden_size,
            vocab_size=int(_required(text_config, "vocab_size")),
            max_position_embeddings=int(_required(text_config, "max_position_embeddings")),
            dtype=dtype if dtype is not None else config_dtype(config),
            eos_token_ids=_eos_token_ids(text_config, generation_config_path),
            bos_token_id=getattr(text_config, "bos_token_id", None),
            sliding_windows=_sliding_windows(text_config, num_layers),
            quantization=quantization,
        )


# What the engine relies on each config field for; named when an architecture lacks it.
_FEATURE_OF_FIELD = {
    "num_attention_heads": "attention layers (it keeps attention's keys and values in a paged KV "
    "cache; state-space and recurrent models have none)",
    "hidden_size": "a single hidden size",
    "num_hidden_layers": "a single stack of decoder layers",
    "vocab_size": "a single token vocabulary",
    "max_position_embeddings": "a maximum context length (max_position_embeddings) to size requests by",
    "head_dim": "one attention head size shared by every layer",
    "num_key_value_heads": "one KV head count shared by every layer",
}


def _optional(config, field: str):
    try:
        return getattr(config, field, None)
    except RuntimeError as exc:
        # transformers raises this for a per-layer attribute of a heterogeneous config (layers of
        # different shapes): there is no one value to read.
        raise _unsupported(config, field, f"its {field} differs from layer to layer") from exc


def _required(config, field: str):
    value = _optional(config, field)
    if value is None:
        raise _unsupported(config, field, f"its config has no {field}")
    return value


def _unsupported(config, field: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"model_type {config.model_type!r} is not supported: the engine needs "
        f"{_FEATURE_OF_FIELD[field]}, and {why}"
    )


def _causal_lm_class_name(config) -> str:
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnsupportedModelError(
            f"transformers has no causal-LM class for model_type {config.model_type!r}"
        )
    # transformers annotates every auto mapping's value as a tokenizer-style (slow, fast) pair;
    # the model mappings hold one class.
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__  # type: ignore[attr-defined]


def config_dtype(config) -> torch.dtype:
    """The dtype a config says its weights are in (`dtype`, or the older `torch_dtype`)."""
    value = getattr(config, "dtype", None)
    if value is None:
        value = config.to_dict().get("torch_dtype")
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"config dtype {value!r} is not one of {sorted(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[name]


def _as_id_set(value, source: str) -> frozenset[int]:
    if value is None:
        return frozenset()
    ids = [value] if isinstance(value, int) else value
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise ModelLoadError(f"eos_token_id in {source} must be an int or a list of ints, got {value!r}")
    return frozenset(ids)


def _eos_token_ids(config, generation_config_path: str | Path | None) -> frozenset[int]:
    # generation_config.json is what `generate` honours, and it often lists more EOS ids than
    # config.json (Llama 3: <|end_of_text|> and <|eot_id|>), so it wins when present.
    if generation_config_path is not None and Path(generation_config_path).is_file():
        path = Path(generation_config_path)
        try:
            generation = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(generation, dict):
            raise ModelLoadError(f"{path} must hold a JSON object, got {type(generation).__name__}")
        if generation.get("eos_token_id") is not None:
            return _as_id_set(generation["eos_token_id"], str(path))
    return _as_id_set(getattr(config, "eos_token_id", None), "config.json")


def _sliding_windows(config, num_layers: int) -> tuple[int, ...]:
    window = getattr(config, "sliding_window", None)
    # Qwen2-style configs carry a window but switch it off with use_sliding_window=False.
    if not window or getattr(config, "use_sliding_window", True) is False:
        return (FULL_ATTENTION,) * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if kind == "sliding_attention" else FULL_ATTENTION for kind in layer_types)
