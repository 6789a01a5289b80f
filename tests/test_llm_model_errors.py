"""Model folders the engine cannot serve fail at `LLM(...)` with a message naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from compiled_engine import LLM
from compiled_engine.errors import LoweringError, ModelLoadError, UnsupportedModelError


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))


def test_folder_without_config(tmp_path, llama_dir):
    d = _copy(llama_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(d)


def test_malformed_config(tmp_path, llama_dir):
    d = _copy(llama_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(d)


def test_garbage_safetensors(tmp_path, llama_dir):
    d = _copy(llama_dir, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(d)


def test_truncated_safetensors(tmp_path, llama_dir):
    d = _copy(llama_dir, tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(d)


def test_unknown_architecture(tmp_path, llama_dir):
    d = _copy(llama_dir, tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_type"] = "definitely_not_an_arch"
    cfg["architectures"] = ["DefinitelyNotAnArchForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="definitely_not_an_arch"):
        LLM(d)


class HandRolledConfig(PretrainedConfig):
    model_type = "ce_hand_rolled_attention"

    def __init__(self, vocab_size=64, hidden_size=32, num_attention_heads=2, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.num_hidden_layers = 1
        self.max_position_embeddings = 128
        super().__init__(**kwargs)


class HandRolledAttentionForCausalLM(PreTrainedModel):
    """Attention written out as softmax(q·kᵀ)·v: nothing the engine can route to its paged op."""

    config_class = HandRolledConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, position_ids=None, logits_to_keep=0, **kwargs):
        h = self.embed(input_ids)
        n, heads = h.shape[1], self.config.num_attention_heads
        q, k, v = self.qkv(h).view(1, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        causal = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()
        attn = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v
        h = attn.transpose(1, 2).reshape(1, n, -1)
        if isinstance(logits_to_keep, torch.Tensor):
            h = h[:, logits_to_keep]
        return CausalLMOutput(logits=self.lm_head(h))


def test_unlowerable_attention_is_rejected_by_name(tmp_path, llama_dir):
    AutoConfig.register(HandRolledConfig.model_type, HandRolledConfig, exist_ok=True)
    AutoModelForCausalLM.register(HandRolledConfig, HandRolledAttentionForCausalLM, exist_ok=True)
    model = HandRolledAttentionForCausalLM(HandRolledConfig())
    out = tmp_path / "hand-rolled"
    model.save_pretrained(out)
    with pytest.raises(LoweringError) as info:
        LLM(str(out), dtype="float32", num_kv_blocks=8)
    message = str(info.value)
    assert "HandRolledAttentionForCausalLM" in message
    assert "softmax" in message.lower()
