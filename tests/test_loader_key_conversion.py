"""load_model maps checkpoint names to module names with transformers' own key conversion.

Mixtral is the example: `save_pretrained` writes one tensor per expert
(`block_sparse_moe.experts.3.w1.weight`) while the module holds all experts stacked in one
`mlp.experts.gate_up_proj`; transformers' registered converter merges them on load, and so must we.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BloomConfig, MambaConfig

from compiled_engine.errors import ModelLoadError, UnsupportedModelError
from compiled_engine.model_loader.loader import load_model
from compiled_engine.model_loader.model_config import ModelConfig
from tests.model_factory import make_tiny_model, make_tiny_model_of_type


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return make_tiny_model_of_type(tmp_path_factory.mktemp("mixtral"), "mixtral", seed=5)


def _rewrite(model_dir, change) -> None:
    path = model_dir / "model.safetensors"
    tensors = change(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})


def test_per_expert_checkpoint_loads_into_stacked_experts(mixtral_dir):
    saved = load_file(mixtral_dir / "model.safetensors")
    # The folder really is in the original layout, so this exercises a converter, not a rename.
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in saved
    loaded = load_model(mixtral_dir).model
    stacked = dict(loaded.named_parameters())
    assert not any(".experts.3." in name for name in stacked)
    reference = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32)
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ids = torch.randint(0, 384, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_a_missing_expert_is_an_error_naming_the_folder(mixtral_dir, tmp_path):
    broken = tmp_path / "mixtral"
    shutil.copytree(mixtral_dir, broken)
    gone = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    _rewrite(broken, lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(ModelLoadError, match=str(broken)):
        load_model(broken)


def test_an_unexpected_tensor_beside_converted_ones_is_named(mixtral_dir, tmp_path):
    broken = tmp_path / "mixtral"
    shutil.copytree(mixtral_dir, broken)
    _rewrite(broken, lambda t: {**t, "model.layers.0.block_sparse_moe.extra_gate.weight": torch.zeros(4, 64)})
    with pytest.raises(
        ModelLoadError, match="does not have: model.layers.0.block_sparse_moe.extra_gate.weight"
    ):
        load_model(broken)


def test_names_without_the_base_model_prefix_load_and_slice_per_rank(tmp_path):
    # A checkpoint written from the bare LlamaModel has no "model." prefix; transformers adds it
    # while loading. The rank's slice is still chosen by the module name the tensor fills.
    model_dir = make_tiny_model(tmp_path, "llama", seed=4, with_tokenizer=False)
    full = {name: value.clone() for name, value in load_model(model_dir).model.named_parameters()}
    _rewrite(model_dir, lambda t: {k.removeprefix("model."): v for k, v in t.items()})
    assert "layers.0.self_attn.q_proj.weight" in load_file(model_dir / "model.safetensors")
    for rank in (0, 1):
        loaded = load_model(model_dir, tensor_parallel=(rank, 2))
        layout = loaded.tensor_parallel
        for name, param in loaded.model.named_parameters():
            shard = layout.shard(name, tuple(full[name].shape))
            expected = full[name] if shard is None else full[name][shard.index(full[name].dim())]
            if layout.zero_on_this_rank(name):
                expected = torch.zeros_like(expected)
            assert torch.equal(param, expected), name


@pytest.mark.parametrize(
    ("config", "feature"),
    [
        (MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=384), "attention layers"),
        (BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=384), "max_position_embeddings"),
    ],
)
def test_model_config_refusal_names_the_feature_the_engine_needs(config, feature):
    with pytest.raises(UnsupportedModelError, match=f"{config.model_type}.*{feature}"):
        ModelConfig.from_hf(config)


def test_an_expert_of_the_wrong_shape_fails_its_conversion_by_name(mixtral_dir, tmp_path):
    broken = tmp_path / "mixtral"
    shutil.copytree(mixtral_dir, broken)
    damaged = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    _rewrite(broken, lambda t: {**t, damaged: torch.zeros(3, 3)})
    with pytest.raises(ModelLoadError, match="could not be converted") as info:
        load_model(broken)
    assert damaged in str(info.value) and str(broken) in str(info.value)
