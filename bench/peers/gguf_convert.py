"""Converts a bench model folder to GGUF with llama.cpp's own convert_hf_to_gguf.py.

    DIR/gguf-venv/bin/python bench/peers/gguf_convert.py LLAMA_SRC MODEL_DIR OUT.gguf {f32,bf16,f16,q8_0}

Runs in the gguf venv scripts/peers/llamacpp_build.sh makes (torch, transformers and the vendored
gguf-py), never in ours. The bench models are random weights with no tokenizer (bench-small) or a
tokenizer the converter does not recognise, and the converter refuses both. So it converts a scratch
copy: the weights and config linked unchanged, plus a small byte-level BPE tokenizer written here,
and the converter's pre-tokenizer lookup falls back to llama.cpp's "default" type for it. The vocab
only names the token ids; the benchmarks feed ids, so it changes nothing they time.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

# Weight and config files the converter reads; every other file of the folder is left out.
LINKED = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def _byte_level_tokenizer(vocab_size: int) -> dict:
    """A tokenizer.json: the 256 byte symbols, one merge (llama.cpp's BPE needs merges), padding ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab["Ġt"] = len(vocab)
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(vocab)} byte-level tokens")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return json.loads(tokenizer.to_str())


def scratch_copy(model_dir: Path, scratch: Path) -> Path:
    for name in LINKED:
        if (model_dir / name).exists():
            os.symlink((model_dir / name).resolve(), scratch / name)
    for shard in model_dir.glob("model-*.safetensors"):
        os.symlink(shard.resolve(), scratch / shard.name)
    config = json.loads((model_dir / "config.json").read_text())
    (scratch / "tokenizer.json").write_text(json.dumps(_byte_level_tokenizer(int(config["vocab_size"]))))
    (scratch / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return scratch


def _default_pre_tokenizer(base_class) -> None:
    """An unrecognised tokenizer hash maps to llama.cpp's "default" pre-tokenizer, not an error."""
    original = base_class.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "default"

    base_class.get_vocab_base_pre = get_vocab_base_pre


def convert(llama_src: Path, model_dir: Path, out: Path, outtype: str) -> None:
    sys.path.insert(0, str(llama_src))
    import convert_hf_to_gguf
    from conversion.base import TextModel

    _default_pre_tokenizer(TextModel)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tempfile.TemporaryDirectory(prefix="gguf-src-") as scratch:
        scratch_copy(model_dir, Path(scratch))
        sys.argv = ["convert_hf_to_gguf.py", scratch, "--outfile", str(partial), "--outtype", outtype]
        convert_hf_to_gguf.main()
    # Renamed only when complete: a killed conversion never leaves a GGUF the bench would trust.
    partial.rename(out)


if __name__ == "__main__":
    # q8_0: the converter's own Q8_0 (blocks of 32 weights, one scale each); Q4_0 needs llama-quantize.
    if len(sys.argv) != 5 or sys.argv[4] not in ("f32", "bf16", "f16", "q8_0"):
        sys.exit("usage: gguf_convert.py LLAMA_SRC MODEL_DIR OUT.gguf {f32,bf16,f16,q8_0}")
    convert(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
