"""Tiny random sentence-transformers folders for the embedding tests, written by the library's own save.

The body is a tiny random model from tests/model_factory.py; sentence-transformers loads it as its
Transformer module (AutoModel), adds Pooling (and Normalize) and saves the whole pipeline, so the
folder is exactly what a user downloads: modules.json, 1_Pooling/config.json, the body's weights
and tokenizer at the top.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModel, BertConfig, RobertaConfig

from tests.model_factory import DEFAULT_VOCAB_SIZE, PAD_ID, build_tokenizer, make_tiny_model

try:  # sentence-transformers >= 6
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
except ImportError:  # 5.x
    from sentence_transformers.models import Normalize, Pooling, Transformer  # type: ignore[no-redef]

from sentence_transformers import SentenceTransformer

_ENCODER_CONFIGS = {"bert": BertConfig, "roberta": RobertaConfig}


def make_tiny_encoder(tmp_path: Path, arch: str, seed: int, name: str) -> Path:
    """A tiny random BERT- or RoBERTa-style encoder folder (fp32, seeded weights, the BPE tokenizer).

    RoBERTa numbers positions from padding_idx + 1 (here 1), so its table has two extra rows.
    """
    config = _ENCODER_CONFIGS[arch](
        vocab_size=DEFAULT_VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=514 if arch == "roberta" else 512,
        type_vocab_size=2,
        pad_token_id=PAD_ID,
    )
    with torch.random.fork_rng(devices=[]):
        model = AutoModel.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            # LayerNorm weights around 1, everything else large enough that layers matter.
            param.copy_(1.0 + 0.1 * noise if "LayerNorm.weight" in param_name else 0.1 * noise)
    out = tmp_path / name
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def make_sentence_transformers_folder(
    tmp_path: Path,
    arch: str = "qwen3",
    pooling_mode: str = "lasttoken",
    normalize: bool = True,
    seed: int = 0,
) -> Path:
    name = f"body-{arch}-{pooling_mode}-{seed}"
    if arch in _ENCODER_CONFIGS:
        body = make_tiny_encoder(tmp_path, arch, seed, name)
    else:
        body = make_tiny_model(tmp_path, arch, seed=seed, name=name)
    modules = [Transformer(str(body)), Pooling(64, pooling_mode=pooling_mode)]
    if normalize:
        modules.append(Normalize())
    out = tmp_path / f"st-{arch}-{pooling_mode}-{'norm' if normalize else 'raw'}-{seed}"
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


# Small enough that TEXTS (4 to 106 tokens) run as several packed steps of at most 3 inputs.
PACKED = {"max_model_len": 128, "max_num_batched_tokens": 128, "max_num_seqs": 3}

# Mixed lengths: a few tokens up to well past one KV block (16 tokens) and into several.
TEXTS = [
    "hello",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import heapq\nheapq.heappush(items, (priority, task))",
    "Ünïcödé façade naïve café résumé — 中文字符测试",
    "x",
    "for line in text.splitlines():\n    if line.strip():\n        yield line.rstrip()\n" * 2,
]
