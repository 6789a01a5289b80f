"""Builds tiny random Hugging Face model folders (weights, config, tokenizer) for tests.

A folder made here looks like a real checkpoint: `config.json`, `model.safetensors` (or shards plus
`model.safetensors.index.json`), `generation_config.json` and a byte-level BPE tokenizer trained
offline on a few of the standard library's own `.py` files plus some non-ASCII text, so multi-byte
UTF-8 characters really do get split across tokens.

Usage from other tests:

    from tests.model_factory import build_tokenizer, make_tiny_model
    model_dir = make_tiny_model(tmp_path, arch="qwen3", seed=1)
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
# The trainer numbers special tokens first, in this order.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

DEFAULT_VOCAB_SIZE = 384

_CONFIG_CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}

# Small, stable stdlib modules: enough Python text for a few hundred merges, read from disk (no network).
_CORPUS_MODULES = ("textwrap.py", "string.py", "heapq.py", "bisect.py", "fnmatch.py", "shlex.py")

# Non-ASCII text in the corpus makes the BPE learn merges of partial UTF-8 sequences (two bytes of a
# three-byte character, say), which is exactly what incremental detokenisation has to cope with.
MULTILINGUAL_TEXT = (
    "Ünïcödé façade naïve café résumé — «quotes» ‘single’ “double” … "
    "中文字符测试，你好世界。日本語のテキスト、こんにちは。한국어 텍스트 안녕하세요. "
    "Ελληνικά κείμενα, Русский текст, עברית, العربية. Emoji: 😀🚀🎉👍🏽 ∑∫√∞≠≤≥ "
)


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in _CORPUS_MODULES]
    texts.extend([MULTILINGUAL_TEXT] * 50)
    return texts


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int, add_bos: bool) -> str:
    if vocab_size < 256 + 3:
        raise ValueError(f"vocab_size must be at least 259 (256 bytes + 3 special tokens), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, BOS_ID)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_ID and tokenizer.token_to_id(BOS_TOKEN) == BOS_ID
    # Cache the serialised form, not the object: every caller gets its own mutable tokenizer.
    return tokenizer.to_str()


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, add_bos: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with at most `vocab_size` tokens (trained once per process)."""
    tokenizer = Tokenizer.from_str(_trained_tokenizer_json(vocab_size, add_bos))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )


def _unique_dir(parent: Path, name: str) -> Path:
    candidate, n = parent / name, 1
    while candidate.exists():
        n += 1
        candidate = parent / f"{name}-{n}"
    candidate.mkdir(parents=True)
    return candidate


def make_tiny_model(
    tmp_path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    eos_token_id: int | list[int] = EOS_ID,
    max_shard_size: str | int | None = None,
    with_tokenizer: bool = True,
    add_bos: bool = True,
    init_std: float = 0.1,
    config_overrides: dict | None = None,
    name: str | None = None,
) -> Path:
    """Save a tiny random fp32 causal LM under `tmp_path` and return its folder.

    Every parameter is drawn from a generator seeded with `seed` (norm weights around 1, the rest
    normal with `init_std`), so the same arguments always give the same weights, and a loader that
    mixes tensors up changes the logits. `max_shard_size` (e.g. "40KB") saves sharded files with an
    index; `eos_token_id` may be a list, as Llama 3 and Qwen checkpoints have.
    """
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"arch must be one of {sorted(_CONFIG_CLASSES)}, got {arch!r}")
    config = _CONFIG_CLASSES[arch](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=eos_token_id,
        pad_token_id=PAD_ID,
        **(config_overrides or {}),
    )
    # transformers' own random init draws from the global RNG; keep the caller's stream untouched.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.ndim == 1 and "norm" in param_name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(init_std * noise)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=eos_token_id, pad_token_id=PAD_ID
    )

    out_dir = _unique_dir(Path(tmp_path), name or f"tiny-{arch}-seed{seed}")
    save_kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    if with_tokenizer:
        build_tokenizer(vocab_size, add_bos).save_pretrained(out_dir)
    return out_dir


# -- a tiny config for any architecture ------------------------------------------------------------

# Sizes small enough that any causal LM builds and saves in well under a second. Only the names a
# config class has are set, so one table serves every architecture; a config's own `__post_init__`
# then derives what follows from them (layer_types, head dims, ...).
TINY_SIZES: dict[str, object] = {
    "vocab_size": DEFAULT_VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    # Gemma 3n / 4 per-layer input embeddings (a second vocabulary-sized table)
    "vocab_size_per_layer_input": DEFAULT_VOCAB_SIZE,
    "unpadded_vocab_size": DEFAULT_VOCAB_SIZE,
    # ids inside the tiny vocabulary (many configs default to ids of a 32k+ one)
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    # encoder-decoder families whose decoder alone is a causal LM (Bart, Pegasus, ...)
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    # mixture of experts
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "zero_expert_num": 2,
    "moe_topk": 2,
    "expert_ffn_hidden_size": 32,
    "ffn_hidden_size": 128,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # multi-head latent attention
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # vision / audio towers of composite configs
    "image_size": 32,
    "patch_size": 8,
    "projection_dim": 64,
}


def _settable_names(config_class) -> set[str]:
    import dataclasses

    names = (
        {field.name for field in dataclasses.fields(config_class)}
        if dataclasses.is_dataclass(config_class)
        else set()
    )
    return names | set(getattr(config_class, "attribute_map", {}) or {})


def tiny_config_kwargs(config_class, sizes: dict[str, object] | None = None) -> dict[str, object]:
    """Constructor kwargs that shrink `config_class` (and each of its sub-configs) to test size."""
    sizes = TINY_SIZES if sizes is None else sizes
    names = _settable_names(config_class)
    kwargs = {key: value for key, value in sizes.items() if key in names}
    for key, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if isinstance(sub_class, type):
            kwargs[key] = tiny_config_kwargs(sub_class, sizes)
    return kwargs


def tiny_config(config_class, **overrides):
    """A tiny instance of any transformers config class (raises whatever the class raises)."""
    kwargs = tiny_config_kwargs(config_class)
    kwargs.update(overrides)
    return config_class(**kwargs)


# What a few config classes' own validation needs beyond TINY_SIZES (values that must agree with
# them: per-layer patterns, head counts, constraints of the architecture).
TINY_OVERRIDES: dict[str, dict[str, object]] = {
    "dots3_note": {"num_key_value_heads": 4},
    "dots3_note_text": {"num_key_value_heads": 4},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "mamba2": {"num_heads": 8},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 32]},
    "xlnet": {"d_head": 16},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"]},
    "zaya": {"num_experts_per_tok": 1},
}


class TinyModelUnavailable(Exception):
    """The tiny-config factory cannot build this architecture; the message says why."""


# Anything larger than this is not "tiny": a vision tower or a fixed-size table the sizes above miss.
TINY_PARAMETER_LIMIT = 5_000_000


def make_tiny_model_of_type(
    tmp_path: str | Path, model_type: str, *, seed: int = 0, config_overrides: dict | None = None
) -> Path:
    """Save a tiny random fp32 model of `model_type`'s causal-LM class with `save_pretrained`.

    Raises TinyModelUnavailable (with the reason) where no tiny config of that type can be built:
    a config the class's own validation rejects at these sizes, a model that needs an optional
    library, or one over TINY_PARAMETER_LIMIT parameters. No tokenizer is written.
    """
    from transformers import CONFIG_MAPPING

    try:
        overrides = {**TINY_OVERRIDES.get(model_type, {}), **(config_overrides or {})}
        config = tiny_config(CONFIG_MAPPING[model_type], **overrides)
    except Exception as exc:  # each config class validates in its own way
        raise TinyModelUnavailable(f"no tiny {model_type} config: {type(exc).__name__}: {exc}") from exc
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # modelling code asserts, raises ImportError for optional libraries, ...
        raise TinyModelUnavailable(
            f"{model_type} does not build from a tiny config: {type(exc).__name__}: {exc}"
        ) from exc
    count = sum(p.numel() for p in skeleton.parameters())
    if count > TINY_PARAMETER_LIMIT:
        biggest = max(skeleton.named_parameters(), key=lambda item: item[1].numel())[0]
        raise TinyModelUnavailable(
            f"{model_type} stays at {count} parameters with tiny sizes (largest: {biggest})"
        )
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Distinct random values in every tensor (init leaves many at 0 or 1), so a loader that puts a
    # tensor in the wrong place, or an expert in the wrong slot, is seen.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32))
    out_dir = _unique_dir(Path(tmp_path), f"tiny-{model_type}-seed{seed}")
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
