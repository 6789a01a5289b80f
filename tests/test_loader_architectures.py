"""Every causal LM transformers knows: a folder `save_pretrained` wrote loads as `from_pretrained` loads it.

For each model type in transformers' MODEL_FOR_CAUSAL_LM_MAPPING the tiny-config factory builds a
random fp32 model and saves it. `load_model` must then give exactly the state dict that
`from_pretrained` gives for the same folder, or refuse with UnsupportedModelError naming what the
engine does not run; a tensor-name mismatch (missing or unexpected tensors) is always a failure.
Types the factory cannot build (vision towers, configs that reject tiny sizes, ...) are skipped with
the reason.

The default run covers every type whose checkpoint names transformers converts while loading (the
point of this file) plus a few plain ones; `-m slow` sweeps the rest.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from compiled_engine.errors import ModelLoadError, UnsupportedModelError
from compiled_engine.model_loader.loader import load_model
from tests.model_factory import TinyModelUnavailable, make_tiny_model_of_type

# Types without key conversion that the default run keeps: common plain layouts, and two the engine
# refuses (no attention; no max_position_embeddings), so the refusal path is checked every run.
PLAIN_REPRESENTATIVES = ("llama", "qwen3", "gpt2", "gemma2", "phi", "opt", "mamba", "bloom")


def _has_key_conversion(model_type: str) -> bool:
    # The lookup transformers' loader makes (by class name, then by model type), also for the model
    # types of the config's sub-configs (Qwen3.5-MoE's causal LM holds a text model with its own).
    names = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], model_type]
    sub_configs = getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {}
    names += [sub.model_type for sub in sub_configs.values() if getattr(sub, "model_type", "")]
    return any(get_checkpoint_conversion_mapping(name) is not None for name in names)


ALL_TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
CONVERTED_TYPES = [t for t in ALL_TYPES if _has_key_conversion(t)]
DEFAULT_TYPES = CONVERTED_TYPES + [t for t in PLAIN_REPRESENTATIVES if t not in CONVERTED_TYPES]
SLOW_TYPES = [t for t in ALL_TYPES if t not in DEFAULT_TYPES]

# Words of a tensor-name mismatch in the loader's errors; a refusal must never be one of those.
_NAME_MISMATCH = ("does not have", "missing tensor", "have no data")


def _short(exc: object) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 240 else text[:240] + "..."


def _saved_folder(tmp_path, model_type: str):
    try:
        return make_tiny_model_of_type(tmp_path, model_type, seed=3)
    except TinyModelUnavailable as exc:
        pytest.skip(f"tiny-config factory: {_short(exc)}")


def _reference_state_dict(folder) -> dict[str, torch.Tensor]:
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, output_loading_info=True
        )
    except Exception as exc:  # transformers' own failure is no finding about our loader
        pytest.skip(f"transformers' from_pretrained cannot read back its own folder: {_short(exc)}")
    if info["missing_keys"] or info["mismatched_keys"]:
        pytest.skip(f"transformers does not round-trip this folder itself: {_short(info)}")
    reference = model.state_dict()
    # A tensor saved under its module name must come back as saved; where from_pretrained changes it
    # (Youtu re-initialises the embedding's padding row after loading), it is no reference.
    saved = {}
    for path in sorted(folder.glob("*.safetensors")):
        saved.update(load_file(path))
    altered = [n for n, t in saved.items() if n in reference and not torch.equal(reference[n], t)]
    if altered:
        pytest.skip(f"transformers' from_pretrained changes saved tensor(s) {altered[:3]}")
    return reference


def _check_loads_like_from_pretrained(tmp_path, model_type: str) -> None:
    folder = _saved_folder(tmp_path, model_type)
    reference = _reference_state_dict(folder)
    try:
        loaded = load_model(folder).model
    except UnsupportedModelError as exc:
        # A refusal is allowed only when it names something the engine does not run.
        assert not any(words in str(exc) for words in _NAME_MISMATCH), str(exc)
        return
    except ModelLoadError as exc:
        pytest.fail(f"{model_type}: a folder save_pretrained wrote must load: {exc}")
    ours = loaded.state_dict()
    assert ours.keys() == reference.keys()
    differing = [name for name, value in reference.items() if not torch.equal(ours[name], value)]
    assert not differing, f"{model_type}: tensors differ from from_pretrained: {differing[:5]}"


def test_the_default_run_holds_every_converted_type():
    # The renamed/converted architectures are the reason for this file: they never move to slow.
    assert CONVERTED_TYPES, "transformers registers no checkpoint conversion: the lookup broke"
    assert {"mixtral", "qwen3_moe", "gpt_neox"} <= set(CONVERTED_TYPES)


@pytest.mark.parametrize("model_type", DEFAULT_TYPES)
def test_saved_folder_loads_like_from_pretrained(tmp_path, model_type):
    _check_loads_like_from_pretrained(tmp_path, model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SLOW_TYPES)
def test_saved_folder_loads_like_from_pretrained_sweep(tmp_path, model_type):
    _check_loads_like_from_pretrained(tmp_path, model_type)
