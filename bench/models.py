"""The models the suites time: "bench-small" (built here, seeded) and the embedded model if present."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

# A random Llama big enough that GEMMs, not Python, dominate a batched step, small enough for 2 cores.
BENCH_SMALL_CONFIG = {
    "hidden_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1408,
    "vocab_size": 4000,
    # Prompts up to 512 plus outputs up to 256 must fit.
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
BENCH_SMALL_SEED = 1234
# Bumped whenever BENCH_SMALL_CONFIG or the initialisation changes, so a stale cached copy is rebuilt.
BENCH_SMALL_VERSION = "1"

# Qwen2.5-0.5B's shape (its published config), random weights saved in bf16: the size where one
# decode step is a ~1 GB weight read, for the peer comparison (#19). Not in any profile's default
# models (a full run would take hours): `--bench-model qwen2.5-0.5b-shape` asks for it.
QWEN05_SHAPE_CONFIG = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
QWEN05_SHAPE_SEED = 4321
QWEN05_SHAPE_VERSION = "1"

CACHE_ENV = "COMPILED_ENGINE_BENCH_CACHE"
BENCH_SMALL = "bench-small"
EMBEDDED = "embedded"
QWEN05_SHAPE = "qwen2.5-0.5b-shape"
# The tiny random Llama the unit tests build (tests/model_factory.py, default arguments): only the
# start-up suite times it, for the warm/cold ratio on "the test model".
TEST_TINY = "test-tiny"
TEST_TINY_SEED = 0


class BenchModel(NamedTuple):
    name: str
    path: Path | None  # None when the model is not available on this checkout
    missing_reason: str = ""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "compiled-engine" / "bench"))


def _build_bench_small(out_dir: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**BENCH_SMALL_CONFIG)
    # transformers' init draws from the global RNG: fork it so building leaves callers' streams alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BENCH_SMALL_SEED)
        model = LlamaForCausalLM(config).to(torch.float32)
    _randomise(model, BENCH_SMALL_SEED)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out_dir, safe_serialization=True)


def _randomise(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            # Norms near 1, everything else small: activations stay finite through the layers.
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.02 * noise)


def _build_qwen05_shape(out_dir: Path) -> None:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**QWEN05_SHAPE_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(QWEN05_SHAPE_SEED)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    _randomise(model, QWEN05_SHAPE_SEED)
    model = model.to(torch.bfloat16)
    eos = QWEN05_SHAPE_CONFIG["eos_token_id"]
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(out_dir, safe_serialization=True)


def _build_test_tiny(out_dir: Path) -> None:
    from tests.model_factory import make_tiny_model

    built = make_tiny_model(out_dir, seed=TEST_TINY_SEED, name="model")
    for item in built.iterdir():
        item.rename(out_dir / item.name)
    built.rmdir()


def bench_small_dir(root: Path | None = None) -> Path:
    """The bench-small folder, built once and reused (the build is deterministic for a version)."""
    return _built_once(
        (root or cache_root()) / f"{BENCH_SMALL}-v{BENCH_SMALL_VERSION}",
        _build_bench_small,
        {"seed": BENCH_SMALL_SEED, "version": BENCH_SMALL_VERSION, **BENCH_SMALL_CONFIG},
    )


def qwen05_shape_dir(root: Path | None = None) -> Path:
    """The Qwen2.5-0.5B-shaped folder (~1 GB), built once and reused."""
    return _built_once(
        (root or cache_root()) / f"{QWEN05_SHAPE}-v{QWEN05_SHAPE_VERSION}",
        _build_qwen05_shape,
        {"seed": QWEN05_SHAPE_SEED, "version": QWEN05_SHAPE_VERSION, **QWEN05_SHAPE_CONFIG},
    )


def tiny_test_model_dir(root: Path | None = None) -> Path:
    """The unit tests' tiny model, saved once under the bench cache."""
    return _built_once((root or cache_root()) / TEST_TINY, _build_test_tiny, {"seed": TEST_TINY_SEED})


def _built_once(target: Path, build, info: dict) -> Path:
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a crashed or concurrent build never leaves half a model.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        (staging / "bench_model.json").write_text(json.dumps(info))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def embedded_model() -> BenchModel:
    """The model shipped with the package, or a BenchModel saying why it is not there."""
    try:
        from compiled_engine.default_model_path import default_model_dir
    except ImportError as exc:
        return BenchModel(EMBEDDED, None, f"compiled_engine.default_model_path is not importable: {exc}")
    try:
        path = Path(default_model_dir())
    except FileNotFoundError as exc:
        return BenchModel(EMBEDDED, None, str(exc))
    if not (path / "config.json").exists():
        return BenchModel(EMBEDDED, None, f"the embedded model folder {path} has no config.json yet")
    return BenchModel(EMBEDDED, path)


def model_names() -> list[str]:
    return [EMBEDDED, BENCH_SMALL, TEST_TINY, QWEN05_SHAPE]


def resolve_model(name: str) -> BenchModel:
    """A model by suite name; bench-small is built on first use."""
    if name == BENCH_SMALL:
        return BenchModel(BENCH_SMALL, bench_small_dir())
    if name == EMBEDDED:
        return embedded_model()
    if name == TEST_TINY:
        return BenchModel(TEST_TINY, tiny_test_model_dir())
    if name == QWEN05_SHAPE:
        return BenchModel(QWEN05_SHAPE, qwen05_shape_dir())
    raise ValueError(f"unknown bench model {name!r}; expected one of {model_names()}")


def max_positions(model_dir: Path) -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))
