"""load_model: parity with transformers' own loader, dtypes, shards, tied weights, and every error."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
)

from compiled_engine.errors import ModelLoadError, UnsupportedModelError
from compiled_engine.model_loader.loader import LoadedModel, load_model
from compiled_engine.model_loader.model_config import FULL_ATTENTION, ModelConfig
from tests.model_factory import EOS_ID, make_tiny_model

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    made = {arch: make_tiny_model(root, arch, seed=i) for i, arch in enumerate(ARCHS)}
    made["tied"] = make_tiny_model(root, "qwen2", seed=7, tie_word_embeddings=True, name="tied")
    made["sharded"] = make_tiny_model(root, "llama", seed=8, max_shard_size="40KB", name="sharded")
    return made


@pytest.fixture
def broken(models, tmp_path):
    """A private copy of the llama folder that a test may damage."""

    def copy(kind: str = "llama") -> Path:
        target = tmp_path / kind
        shutil.copytree(models[kind], target)
        return target

    return copy


def _input_ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, 19), generator=torch.Generator().manual_seed(0))


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


# -- parity and shape of the result -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logits_identical_to_transformers_from_pretrained(models, arch):
    loaded = load_model(models[arch])
    reference = AutoModelForCausalLM.from_pretrained(models[arch])
    ids = _input_ids()
    assert torch.equal(_logits(loaded.model, ids), _logits(reference, ids))
    # Recomputed non-persistent buffers (rotary tables) match the reference loader's.
    reference_buffers = dict(reference.named_buffers())
    for name, buffer in loaded.model.named_buffers():
        assert torch.equal(buffer, reference_buffers[name]), name


@pytest.mark.parametrize("arch", ARCHS)
def test_loaded_model_is_frozen_eval_and_materialised(models, arch):
    loaded = load_model(models[arch])
    assert isinstance(loaded, LoadedModel)
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.model = None
    assert not loaded.model.training
    params = list(loaded.model.parameters())
    assert params and all(not p.requires_grad for p in params)
    assert all(t.device.type == "cpu" for t in [*params, *loaded.model.buffers()])
    assert {p.dtype for p in params} == {torch.float32}


def test_loading_draws_no_random_numbers(models):
    # The model is built on meta and filled from the file: no random init ever runs.
    before = torch.random.get_rng_state()
    load_model(models["llama"])
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_gives_bf16_params_and_matches_transformers(models, arch):
    loaded = load_model(models[arch], dtype="bfloat16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model_config.dtype == torch.bfloat16
    reference = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.bfloat16)
    ids = _input_ids()
    assert torch.equal(_logits(loaded.model, ids), _logits(reference, ids))


def test_float16_and_explicit_float32(models):
    assert {p.dtype for p in load_model(models["llama"], dtype="float16").model.parameters()} == {
        torch.float16
    }
    assert {p.dtype for p in load_model(models["llama"], dtype="float32").model.parameters()} == {
        torch.float32
    }


def test_auto_dtype_follows_config_and_defaults_to_float32(broken):
    model_dir = broken()
    _edit_config(model_dir, dtype="bfloat16")
    assert {p.dtype for p in load_model(model_dir).model.parameters()} == {torch.bfloat16}
    _edit_config(model_dir, dtype=None, torch_dtype="float16")
    assert {p.dtype for p in load_model(model_dir).model.parameters()} == {torch.float16}
    _edit_config(model_dir, torch_dtype=None)
    assert {p.dtype for p in load_model(model_dir).model.parameters()} == {torch.float32}


@pytest.mark.parametrize("bad", ["int8", "fp32", "float64", "", "torch.float32"])
def test_unsupported_dtype_is_named(models, bad):
    with pytest.raises(ModelLoadError, match=repr(bad)):
        load_model(models["llama"], dtype=bad)


def test_tied_embeddings_share_one_tensor(models):
    model_dir = models["tied"]
    with safe_open(model_dir / "model.safetensors", framework="pt") as reader:
        assert "lm_head.weight" not in reader.keys()  # the point of the test: the file lacks it
    loaded = load_model(model_dir)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = _input_ids()
    assert torch.equal(_logits(loaded.model, ids), _logits(reference, ids))


def test_sharded_checkpoint_loads_every_shard(models):
    model_dir = models["sharded"]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (model_dir / "model.safetensors").exists()
    loaded = load_model(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = _input_ids()
    assert torch.equal(_logits(loaded.model, ids), _logits(reference, ids))


# -- ModelConfig --------------------------------------------------------------------------------------


def test_model_config_fields(models):
    config = load_model(models["qwen3"]).model_config
    assert config == ModelConfig(
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        hidden_size=64,
        vocab_size=384,
        max_position_embeddings=512,
        dtype=torch.float32,
        eos_token_ids=frozenset({EOS_ID}),
        bos_token_id=1,
        sliding_windows=(FULL_ATTENTION, FULL_ATTENTION),
    )


def test_eos_ids_from_generation_config_list_win_over_config(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama", eos_token_id=[EOS_ID, 7])
    _edit_config(model_dir, eos_token_id=EOS_ID)
    assert load_model(model_dir).model_config.eos_token_ids == frozenset({EOS_ID, 7})
    (model_dir / "generation_config.json").unlink()
    assert load_model(model_dir).model_config.eos_token_ids == frozenset({EOS_ID})


def test_generation_config_eos_int_and_invalid_json(broken):
    model_dir = broken()
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert load_model(model_dir).model_config.eos_token_ids == frozenset({5})
    (model_dir / "generation_config.json").write_text("{nope")
    with pytest.raises(ModelLoadError, match="generation_config.json is not valid JSON"):
        load_model(model_dir)


def test_sliding_windows_per_layer():
    qwen2 = Qwen2Config(
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=2,
        num_attention_heads=4,
    )
    assert ModelConfig.from_hf(qwen2).sliding_windows == (FULL_ATTENTION, FULL_ATTENTION, 8, 8)
    qwen2_off = Qwen2Config(num_hidden_layers=3, use_sliding_window=False, sliding_window=8)
    assert ModelConfig.from_hf(qwen2_off).sliding_windows == (FULL_ATTENTION,) * 3
    mistral = MistralConfig(num_hidden_layers=2, sliding_window=16)
    assert ModelConfig.from_hf(mistral).sliding_windows == (16, 16)


# -- tokenizer ----------------------------------------------------------------------------------------


def test_tokenizer_loaded_alongside(models):
    tokenizer = load_model(models["llama"]).tokenizer
    text = "def héllo(x): return '中文 😀'"
    ids = tokenizer.encode(text)
    assert ids[0] == 1  # the BOS the factory's tokenizer adds
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_no_tokenizer_files_gives_none(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama", with_tokenizer=False)
    loaded = load_model(model_dir)
    assert loaded.tokenizer is None
    assert loaded.model_config.vocab_size == 384


def test_broken_tokenizer_file(broken):
    model_dir = broken()
    (model_dir / "tokenizer.json").write_text("this is not a tokenizer")
    with pytest.raises(ModelLoadError, match="tokenizer files"):
        load_model(model_dir)


# -- errors: folder and config ------------------------------------------------------------------------


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        load_model(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(info.value)


def test_no_config_json(broken):
    model_dir = broken()
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json") as info:
        load_model(model_dir)
    assert str(model_dir) in str(info.value)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"model_type": "llama",', "not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"hidden_size": 64}', "has no model_type"),
        ('{"model_type": ""}', "has no model_type"),
    ],
)
def test_malformed_config_json(broken, content, message):
    model_dir = broken()
    (model_dir / "config.json").write_text(content)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(model_dir)
    assert str(model_dir / "config.json") in str(info.value)


def test_unknown_model_type(broken):
    model_dir = broken()
    _edit_config(model_dir, model_type="not_a_real_arch")
    with pytest.raises(UnsupportedModelError, match="not_a_real_arch") as info:
        load_model(model_dir)
    assert str(model_dir) in str(info.value)


def test_unknown_architecture_class(broken):
    model_dir = broken()
    _edit_config(model_dir, architectures=["NotARealForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="NotARealForCausalLM"):
        load_model(model_dir)


def test_model_type_without_causal_lm(broken):
    model_dir = broken()
    _edit_config(model_dir, model_type="t5", architectures=None)
    with pytest.raises(UnsupportedModelError, match="no causal-LM class"):
        load_model(model_dir)


# -- errors: weights ----------------------------------------------------------------------------------


def test_no_safetensors_weights(broken):
    model_dir = broken()
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no safetensors weights") as info:
        load_model(model_dir)
    assert str(model_dir) in str(info.value)
    (model_dir / "pytorch_model.bin").write_bytes(b"\x80\x02pickled")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin .*pickle"):
        load_model(model_dir)


@pytest.mark.parametrize(
    "damage", ["garbage", "truncated_half", "truncated_one_byte", "header_only", "empty"]
)
def test_damaged_safetensors(broken, damage):
    model_dir = broken()
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    damaged = {
        "garbage": bytes(range(256)) * 40,
        "truncated_half": data[: len(data) // 2],
        "truncated_one_byte": data[:-1],
        "header_only": data[:20],
        "empty": b"",
    }[damage]
    path.write_bytes(damaged)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file") as info:
        load_model(model_dir)
    assert str(path) in str(info.value)


def test_missing_tensors_are_named(broken):
    model_dir = broken()
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    dropped = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    save_file({k: v for k, v in tensors.items() if k not in dropped}, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing tensor") as info:
        load_model(model_dir)
    assert all(name in str(info.value) for name in dropped)


def test_untied_model_missing_lm_head_is_an_error(broken):
    model_dir = broken()  # llama with tie_word_embeddings=false
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["lm_head.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_model(model_dir)


def test_unexpected_tensor_is_named(broken):
    model_dir = broken()
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="does not have: model.layers.0.self_attn.q_proj.bias"):
        load_model(model_dir)


def test_shape_mismatch_is_named(broken):
    model_dir = broken()
    _edit_config(model_dir, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight .*shape") as info:
        load_model(model_dir)
    assert "(128, 64)" in str(info.value) or "(64, 128)" in str(info.value)


def test_tied_config_with_different_untied_weights(broken):
    model_dir = broken()  # its file holds distinct lm_head and embedding tensors
    _edit_config(model_dir, tie_word_embeddings=True)
    with pytest.raises(ModelLoadError, match="tie_word_embeddings"):
        load_model(model_dir)


def test_shard_listed_in_index_but_absent(broken):
    model_dir = broken("sharded")
    shards = sorted(
        set(json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"].values())
    )
    (model_dir / shards[-1]).unlink()
    with pytest.raises(ModelLoadError, match="missing") as info:
        load_model(model_dir)
    assert shards[-1] in str(info.value) and "model.safetensors.index.json" in str(info.value)


def test_shard_lacking_a_tensor_its_index_promises(broken):
    model_dir = broken("sharded")
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = sorted(set(index["weight_map"].values()))[0]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="lacks tensor.*model.norm.weight"):
        load_model(model_dir)


def test_malformed_index(broken):
    model_dir = broken("sharded")
    index_path = model_dir / "model.safetensors.index.json"
    index_path.write_text("{")
    with pytest.raises(ModelLoadError, match="index.json is not valid JSON"):
        load_model(model_dir)
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ModelLoadError, match="no weight_map"):
        load_model(model_dir)


def test_buffer_the_model_does_not_recompute_is_an_error(models, monkeypatch):
    # If the model's initialiser skipped a non-persistent buffer it would hold uninitialised
    # memory; the loader must notice rather than run with garbage rotary tables.
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", lambda self, module: None)
    with pytest.raises(
        UnsupportedModelError, match=r"does not recompute buffer\(s\) model\.rotary_emb\.inv_freq"
    ):
        load_model(models["llama"])


def test_modules_the_architecture_keeps_in_fp32_stay_fp32(models, monkeypatch):
    # Some architectures declare modules that must stay fp32 under bf16/fp16; honour it as
    # transformers does. Llama declares none, so declare one for this test.
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    monkeypatch.setattr(LlamaPreTrainedModel, "_keep_in_fp32_modules_strict", ["lm_head"])
    loaded = load_model(models["llama"], dtype="bfloat16")
    reference = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.bfloat16)
    ours = {name: p.dtype for name, p in loaded.model.named_parameters()}
    assert ours == {name: p.dtype for name, p in reference.named_parameters()}
    assert ours["lm_head.weight"] == torch.float32 and ours["model.norm.weight"] == torch.bfloat16


def test_model_config_architecture_without_architectures_field():
    assert ModelConfig.from_hf(Qwen2Config()).architecture == "Qwen2ForCausalLM"
    assert ModelConfig.from_hf(Qwen2Config(architectures=["Custom"])).architecture == "Custom"


class _RegisteredConfig(LlamaConfig):
    model_type = "ce_test_registered_llama"


class RegisteredLlamaForCausalLM(LlamaForCausalLM):
    config_class = _RegisteredConfig


def test_class_registered_with_auto_model_loads(tmp_path):
    # In-process registration (no remote code) is how users add architectures transformers lacks.
    AutoConfig.register(_RegisteredConfig.model_type, _RegisteredConfig, exist_ok=True)
    AutoModelForCausalLM.register(_RegisteredConfig, RegisteredLlamaForCausalLM, exist_ok=True)
    model_dir = make_tiny_model(tmp_path, "llama")
    _edit_config(
        model_dir, model_type=_RegisteredConfig.model_type, architectures=["RegisteredLlamaForCausalLM"]
    )
    loaded = load_model(model_dir)
    assert type(loaded.model) is RegisteredLlamaForCausalLM
    assert loaded.model_config.architecture == "RegisteredLlamaForCausalLM"
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = _input_ids()
    assert torch.equal(_logits(loaded.model, ids), _logits(reference, ids))
