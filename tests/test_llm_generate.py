"""`LLM.generate` behaviour a vLLM user relies on: ordering, stop conditions, seeds, the CLI."""

from __future__ import annotations

import json
import shutil

import pytest

from compiled_engine import LLM, SamplingParams
from compiled_engine.entrypoints import cli

PROMPTS = ["def add(a, b):", "import os", "class Stack:", {"prompt_token_ids": [5, 9, 11, 40]}]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=256, enforce_eager=True)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_outputs_in_input_order_with_prompt_fields(llm):
    outs = llm.generate(PROMPTS, _greedy(5), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert len(outs) == len(PROMPTS)
    assert len({o.request_id for o in outs}) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        if isinstance(prompt, str):
            assert out.prompt == prompt
            assert list(out.prompt_token_ids) == tokenizer(prompt)["input_ids"]
        else:
            assert out.prompt is None and list(out.prompt_token_ids) == prompt["prompt_token_ids"]
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length" and len(completion.token_ids) == 5
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    # Each output is the prompt's own: running one alone gives the same tokens.
    alone = llm.generate(PROMPTS[2], _greedy(5), use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_stop_string_spanning_tokens_is_found_and_trimmed(llm):
    full = llm.generate("def add(a, b):", _greedy(24), use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    # Pick a stop string that straddles the boundary between two generated tokens.
    pieces = [tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    cut = next(
        i for i in range(2, len(pieces)) if len(pieces[i - 1]) >= 2 and len(pieces[i]) > len(pieces[i - 1])
    )
    boundary = len(pieces[cut - 1])
    stop = pieces[cut][boundary - 1 : boundary + 1]  # last char of token cut-1 + first of token cut
    expected = full.text[: full.text.index(stop)]
    out = llm.generate("def add(a, b):", _greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == expected
    assert len(out.token_ids) <= cut + 1
    assert llm.engine.num_free_kv_blocks() == llm.engine.num_kv_blocks


def test_stop_token_ids_end_the_request(llm):
    full = llm.generate("import os", _greedy(12), use_tqdm=False)[0].outputs[0]
    stop_token = full.token_ids[4]
    first = full.token_ids.index(stop_token)
    out = llm.generate("import os", _greedy(12, stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    assert out.token_ids == full.token_ids[: first + 1]


def test_eos_from_generation_config_ends_the_request(tmp_path, llama_dir, llm):
    full = llm.generate("class Stack:", _greedy(10), use_tqdm=False)[0].outputs[0]
    eos = full.token_ids[3]
    first = full.token_ids.index(eos)
    folder = shutil.copytree(llama_dir, tmp_path / "m")
    gen_cfg_path = folder / "generation_config.json"
    gen_cfg = json.loads(gen_cfg_path.read_text())
    gen_cfg["eos_token_id"] = [eos]
    gen_cfg_path.write_text(json.dumps(gen_cfg))
    other = LLM(str(folder), dtype="float32", max_model_len=256, enforce_eager=True)
    stops = other.generate("class Stack:", SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    assert stops[0].outputs[0].finish_reason == "stop"
    assert stops[0].outputs[0].token_ids == full.token_ids[: first + 1]
    # ignore_eos=True runs past it.
    ignores = other.generate("class Stack:", _greedy(10), use_tqdm=False)
    assert ignores[0].outputs[0].token_ids == full.token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("def add(a, b):", params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate("def add(a, b):", params, use_tqdm=False)[0].outputs[0].token_ids
    batch = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 3
    batch[1] = params
    mixed = llm.generate(["import os", "def add(a, b):", "class Stack:"], batch, use_tqdm=False)
    assert alone == again == mixed[1].outputs[0].token_ids
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    differs = llm.generate("def add(a, b):", other_seed, use_tqdm=False)[0].outputs[0].token_ids
    assert differs != alone  # 16 draws over a 384-token vocab: equal only by astronomically unlikely chance


def test_unseeded_sampling_varies_but_greedy_does_not(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    sampled = {llm.generate("x = ", params, use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)}
    greedy = {llm.generate("x = ", _greedy(8), use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)}
    assert len(sampled) > 1 and len(greedy) == 1


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate("import os", _greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    top1 = (
        llm.generate(
            "import os",
            SamplingParams(max_tokens=8, temperature=0.7, top_k=1, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert top1 == greedy


def test_cli_generate_prints_prompt_and_continuation(llama_dir, capsys, llm):
    code = cli.main(["generate", "--model", llama_dir, "--max-tokens", "6", "def add(a, b):"])
    assert code == 0
    printed = capsys.readouterr().out
    expected = llm.generate("def add(a, b):", SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert printed.startswith("def add(a, b):" + expected[0].outputs[0].text)


def test_cli_reports_bad_model_folder_in_one_line(tmp_path, capsys):
    code = cli.main(["generate", "--model", str(tmp_path / "missing"), "hi"])
    assert code == 2
    err = capsys.readouterr().err
    assert "missing" in err and "Traceback" not in err
