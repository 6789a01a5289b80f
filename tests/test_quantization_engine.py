"""`quantization` on the engine: the option and its flags, bad input refused at load (before any
compile), and greedy parity with transformers running the same weights dequantized."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from compiled_engine import LLM, SamplingParams
from compiled_engine.engine.async_llm import AsyncLLM
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_args import QUANTIZATION_CHOICES, EngineArgs, ServerArgs
from compiled_engine.entrypoints import cli
from compiled_engine.records.weight_quantization import WEIGHT_QUANTIZATION_SCHEMES, WeightQuantization
from tests.test_async_llm import _final
from tests.test_parity import MAX_NEW_TOKENS, PROMPTS, _hf_reference, compare_with_reference
from tests.test_pass_quantize_linears import round_trip_linears
from tests.test_prefix_caching_engine import ENGINE_OPTIONS as PREFIX_ENGINE_OPTIONS
from tests.test_prefix_caching_engine import _run as _run_workload
from tests.test_prefix_caching_engine import _workload


def _command(name: str):
    (sub,) = [a for a in cli._build_parser()._actions if a.dest == "command"]
    return sub.choices[name]


def test_the_choices_are_the_schemes_the_engine_runs():
    assert QUANTIZATION_CHOICES == WEIGHT_QUANTIZATION_SCHEMES


@pytest.mark.parametrize("command", ["generate", "warmup", "serve"])
def test_every_command_takes_the_flags(command):
    argv = (["hi"] if command == "generate" else []) + [
        "--quantization",
        "int4",
        "--quantization-group-size",
        "64",
    ]
    namespace = _command(command).parse_args(argv)
    args = (ServerArgs if command == "serve" else EngineArgs).from_cli_args(namespace)
    assert (args.quantization, args.quantization_group_size) == ("int4", 64)
    assert args.weight_quantization() == WeightQuantization("int4", 64)
    assert EngineArgs(quantization="int8").weight_quantization() == WeightQuantization("int8")
    assert EngineArgs().weight_quantization() is None
    # The LM head is quantized with the rest unless --no-quantize-lm-head keeps it float.
    assert args.quantize_lm_head is True
    kept = (ServerArgs if command == "serve" else EngineArgs).from_cli_args(
        _command(command).parse_args([*argv, "--no-quantize-lm-head"])
    )
    assert kept.weight_quantization() == WeightQuantization("int4", 64, lm_head=False)
    assert kept.weight_quantization().label == "int4-g64-float-head"


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"quantization": "int3"}, "unknown quantization 'int3': choose one of int8, int4"),
        ({"quantization": "fp8"}, "unknown quantization 'fp8'"),
        (
            {"quantization": "int4", "quantization_group_size": 48},
            "int4 group size must be one of 32, 64, 128, 256",
        ),
        ({"quantization": "int4", "quantization_group_size": "32"}, "quantization_group_size must be an int"),
        ({"quantization": "int8", "tensor_parallel_size": 2}, "not supported with tensor_parallel_size > 1"),
        ({"quantization": "int8", "quantize_lm_head": "no"}, "quantize_lm_head must be True or False"),
        ({"quantize_lm_head": 0}, "quantize_lm_head must be True or False, got 0"),
    ],
)
def test_bad_options_are_refused_when_given(options, needle):
    with pytest.raises(ValueError, match=needle):
        EngineArgs(**options)


def test_a_group_size_that_does_not_divide_a_layer_is_refused_before_any_compile(tmp_path):
    # The embedded model's down_proj takes 704 features: 64 divides it, 128 does not.
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\.mlp\.down_proj: its 704 input"):
        LLM(quantization="int4", quantization_group_size=128, cache_dir=str(tmp_path), compile_policy="ahead")
    assert not any(tmp_path.iterdir()), "something was compiled or cached before the error"


def _dequantized_reference(model_dir: str, scheme: WeightQuantization, prompts):
    """transformers' own greedy generate on the model with each linear the scheme quantizes (the LM
    head too, by default) replaced by its quantize-dequantize round trip: what the quantized engine
    computes."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _hf_reference(model_dir, prompts, model=round_trip_linears(model, scheme))


SCHEMES = {"int8": WeightQuantization("int8"), "int4": WeightQuantization("int4", 32)}


# The default run takes int4 (the coarser scheme, with zero points) on 8 of the 32 prompts (the
# first three are the 1-, 2- and 200-token ones); the rest under -m slow.
@pytest.mark.parametrize(
    "scheme, num_prompts",
    [
        ("int4", 8),
        pytest.param("int4", len(PROMPTS["llama"]), marks=pytest.mark.slow),
        pytest.param("int8", len(PROMPTS["llama"]), marks=pytest.mark.slow),
    ],
)
def test_greedy_parity_with_transformers_on_the_dequantized_weights(scheme, num_prompts, model_dirs):
    prompts = PROMPTS["llama"][:num_prompts]
    llm = LLM(model_dirs["llama"], dtype="float32", enforce_eager=True, quantization=scheme)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    excused = compare_with_reference(
        outputs, _dequantized_reference(model_dirs["llama"], SCHEMES[scheme], prompts)
    )
    print(f"{scheme}: {excused} near-tie divergences excused of {len(prompts)}")
    assert llm.engine.num_free_kv_blocks() == llm.engine.num_kv_blocks


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_compiled_quantized_engine_matches_its_own_eager_run(scheme, model_dirs, tmp_path):
    # Compiled (Inductor, the C++ GEMV where measured faster) against the same engine eager, with
    # chunked prefill and preemption in the way.
    prompts = [{"prompt_token_ids": p} for p in PROMPTS["qwen2"]]
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    common = dict(dtype="float32", quantization=scheme, num_kv_blocks=40, max_num_batched_tokens=64)
    eager = LLM(model_dirs["qwen2"], enforce_eager=True, **common).generate(prompts, params, use_tqdm=False)
    compiled_llm = LLM(model_dirs["qwen2"], compile_policy="blocking", cache_dir=str(tmp_path), **common)
    compiled = compiled_llm.generate(prompts, params, use_tqdm=False)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(eager, compiled, strict=True))
    assert compiled_llm.engine.num_preemptions > 0
    # fp32 both ways; the compiled graph sums in another order, so a near-tie may flip a few.
    assert same >= len(prompts) - 2, f"{same}/{len(prompts)} identical"


@pytest.mark.slow  # ~60 s on a shared 2-core machine: two eager engines through the whole workload
def test_prefix_caching_and_the_async_loop_keep_the_quantized_outputs(llama_dir):
    # The prefix-caching workload (shared system prompts, eviction, chunked prompts) on the int4
    # engine, eager: the cache on and the async loop give the outputs of the plain synchronous run.
    # (tests/test_prefix_caching_engine.py runs its compiled engines quantized too, under -m slow.)
    workload = _workload()[:16]
    results = {}
    for caching, async_ in [(False, False), (True, True)]:
        llm = LLM(
            llama_dir,
            quantization="int4",
            enforce_eager=True,
            enable_prefix_caching=caching,
            async_scheduling=async_,
            **{k: v for k, v in PREFIX_ENGINE_OPTIONS.items() if k != "compile_buckets"},
        )
        results[(caching, async_)] = _run_workload(llm, workload)
        if caching:
            assert llm.stats().prefix_cache_hits > 0
    assert len(results[(False, False)]) == len(workload)
    assert results[(True, True)] == results[(False, False)]


def test_async_llm_streams_what_the_quantized_llm_generates(llama_dir):
    options = dict(dtype="float32", max_model_len=128, enforce_eager=True, quantization="int8")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ["def add(a, b):", "import os"]
    expected = [
        o.outputs[0].token_ids for o in LLM(llama_dir, **options).generate(prompts, params, use_tqdm=False)
    ]
    async_llm = AsyncLLM(LLMEngine(EngineArgs(model=llama_dir, **options)))
    try:

        async def main():
            return await asyncio.gather(*(_final(async_llm, p, params) for p in prompts))

        together = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        async_llm.shutdown()
    assert [o.outputs[0].token_ids for o in together] == expected


@pytest.mark.slow
def test_warmup_rows_show_the_quantization(llama_dir, tmp_path, capsys):
    options = [
        "--dtype",
        "float32",
        "--buckets",
        "1,2",
        "--max-num-seqs",
        "2",
        "--max-num-batched-tokens",
        "32",
    ]
    argv = ["warmup", "--model", llama_dir, "--cache-dir", str(tmp_path), *options, "--quantization", "int4"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].split()[-1] == "weights"
    assert {line.split()[-1] for line in lines[2:]} == {"int4-g32"}
