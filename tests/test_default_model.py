"""The default model shipped inside the package: a real, trained, loadable Hugging Face folder.

Checks that our engine and transformers agree on it token for token, that it stays small, that its
tokenizer and chat template work, and that it has actually learned Python (a check proven, inside
the test, to reject a random model of the same shape).
"""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from compiled_engine import LLM, SamplingParams
from compiled_engine.default_model_path import default_model_dir
from compiled_engine.entrypoints import cli

PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:")
NEW_TOKENS = 24
MAX_PARAMETERS = 20_000_000
MAX_WEIGHTS_BYTES = 40 * 1024 * 1024
PYTHON_KEYWORDS = ("return", "if ", "for ", "while ", "self", "=")


def looks_like_python_function_body(continuation: str) -> bool:
    """After `def f(n):` a Python programmer writes an indented body on the next line that uses
    statements; random token soup essentially never starts with a newline plus indentation and
    contains a statement keyword as well."""
    first_line_break = continuation.find("\n")
    if first_line_break < 0:
        return False
    body = continuation[first_line_break + 1 :]
    rest_of_def_line = continuation[:first_line_break].strip()
    indented = body.startswith((" " * 4, "\t")) and (
        rest_of_def_line == "" or rest_of_def_line.startswith("#")
    )
    return indented and any(word in body for word in PYTHON_KEYWORDS)


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, seed=0)


@pytest.fixture(scope="module")
def engine_greedy(engine):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return {out.prompt: out.outputs[0] for out in engine.generate(list(PROMPTS), params, use_tqdm=False)}


def _hf_greedy(model, tokenizer, prompt: str) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, ids["input_ids"].shape[1] :].tolist()


def test_folder_is_a_normal_hugging_face_checkpoint(model_dir):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (model_dir / name).is_file(), f"{name} missing from {model_dir}"
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert config.tie_word_embeddings
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert config.eos_token_id in generation["eos_token_id"]


def test_size_limits_and_bf16_storage(model_dir, hf_model):
    assert hf_model.num_parameters() <= MAX_PARAMETERS
    weights = model_dir / "model.safetensors"
    assert weights.stat().st_size <= MAX_WEIGHTS_BYTES
    with safe_open(weights, framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes and set(dtypes.values()) == {"BF16"}, dtypes


def test_tokenizer_round_trips_python_source(tokenizer):
    source = inspect.getsource(textwrap) + "\ndef café(x):\n\treturn '→ ünïcode'  # tab-indented\n"
    ids = tokenizer.encode(source, add_special_tokens=False)
    assert tokenizer.decode(ids) == source
    # Prompts start with <|endoftext|>, as every training document did.
    with_bos = tokenizer.encode("x = 1")
    assert with_bos[0] == tokenizer.bos_token_id
    assert tokenizer.decode(with_bos, skip_special_tokens=True) == "x = 1"
    # Byte-level BPE learned the corpus: Python source costs well under one token per 2 characters.
    assert len(ids) < len(source) / 2


def test_chat_template_renders_role_markers(tokenizer):
    messages = [{"role": "user", "content": "Write a loop."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWrite a loop.<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    marker_ids = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(marker_ids[0]) == 2 and ids.count(marker_ids[1]) == 1


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_parity_with_transformers(prompt, engine_greedy, hf_model, tokenizer):
    ours = list(engine_greedy[prompt].token_ids)
    assert ours == _hf_greedy(hf_model, tokenizer, prompt)


def test_fibonacci_continuation_is_python_shaped(engine_greedy, model_dir, tokenizer):
    text = engine_greedy["def fibonacci(n):"].text
    assert looks_like_python_function_body(text), repr(text)

    # The same check must reject untrained weights of the same architecture, or it proves nothing.
    config = AutoConfig.from_pretrained(model_dir)
    for seed in range(3):
        torch.manual_seed(seed)
        random_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        random_ids = _hf_greedy(random_model, tokenizer, "def fibonacci(n):")
        random_text = tokenizer.decode(random_ids, skip_special_tokens=True)
        assert not looks_like_python_function_body(random_text), repr(random_text)


def test_llm_and_cli_default_to_the_embedded_model(engine, capsys):
    # Eager: what is under test is which model the defaults pick; compiled parity is tested elsewhere.
    default = LLM(dtype="float32", enforce_eager=True)
    assert default.engine.config.model_dir == str(default_model_dir())
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ours = default.generate("def fibonacci(n):", params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == engine.generate("def fibonacci(n):", params, use_tqdm=False)[0].outputs[0].token_ids

    assert cli.main(["generate", "--enforce-eager", "--max-tokens", "8", "def fibonacci(n):"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def fibonacci(n):") and len(printed) > len("def fibonacci(n):\n")
