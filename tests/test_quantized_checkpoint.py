"""Pre-quantized compressed-tensors checkpoints (model_loader/quantized_checkpoint.py): folders made
by the compressed-tensors library's own compressor load into the engine's quantized linears and give
the logits transformers gives when it dequantizes the same folder; unsupported configs are named."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from compiled_engine import LLM, SamplingParams
from compiled_engine.errors import UnsupportedModelError
from compiled_engine.records.weight_quantization import WeightQuantization
from tests.quantized_checkpoints import make_compressed_checkpoint
from tests.test_parity import MAX_NEW_TOKENS, TIE_TOLERANCE, _hf_reference

SCHEMES = {
    "int8": (8, None, WeightQuantization("int8", source="compressed-tensors")),
    "int4": (4, 32, WeightQuantization("int4", 32, symmetric=True, source="compressed-tensors")),
}
TOP = 5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed")
    return {name: make_compressed_checkpoint(root, bits, group) for name, (bits, group, _) in SCHEMES.items()}


def _transformers_dequantized(folder) -> torch.nn.Module:
    config = CompressedTensorsConfig(dequantize=True)  # decompress to dense float weights
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=config
    ).eval()


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randint(2, 40))] for _ in range(8)]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_logprobs_match_transformers_dequantizing_the_folder(scheme, folders):
    llm = LLM(str(folders[scheme]), dtype="float32", enforce_eager=True)
    assert llm.engine.config.quantization == SCHEMES[scheme][2]
    prompts = _prompts()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP),
        use_tqdm=False,
    )
    # Every linear but the LM head ran on the checkpoint's own integers (7 per layer, unfused when eager).
    reports = llm.engine.model_runner.step_graph.captured.pass_log
    assert reports and all(r.result("quantize_linears").nodes_rewritten == 7 * 2 for r in reports)
    reference = _transformers_dequantized(folders[scheme])
    worst = 0.0
    with torch.no_grad():
        for ids, out in zip(prompts, outputs, strict=True):
            expected = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            for position in range(1, len(ids)):
                for token, logprob in out.prompt_logprobs[position].items():
                    worst = max(worst, abs(logprob.logprob - float(expected[position - 1, token])))
    assert worst < 1e-3, f"largest logprob difference {worst:.2e}"
    # Greedy continuations, token for token (near-ties excused as in tests/test_parity.py).
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    generated = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # transformers stops at the EOS token (its generation config names one); ours ran on past it.
    for i, (out, (ref_tokens, ref_scores)) in enumerate(
        zip(generated, _hf_reference(str(folders[scheme]), prompts, model=reference), strict=True)
    ):
        ours = list(out.outputs[0].token_ids)[: len(ref_tokens)]
        for step, (a, b) in enumerate(zip(ours, ref_tokens, strict=True)):
            if a != b:
                top2 = torch.topk(ref_scores[step].float(), 2).values
                assert float(top2[0] - top2[1]) <= TIE_TOLERANCE, f"prompt {i} diverges at step {step}"
                break


def _edited(folder, tmp_path, edit) -> str:
    copy = tmp_path / "edited"
    copy.mkdir()
    for path in folder.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    edit(config["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


def _group(config):
    return config["config_groups"]["group_0"]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda c: c.update(quant_method="gptq"), "quant_method 'gptq'"),
        (
            lambda c: (c.update(format="naive-quantized"), _group(c).update(format=None)),
            "format 'naive-quantized'",
        ),
        (lambda c: _group(c)["weights"].update(symmetric=False), "asymmetric weights"),
        (lambda c: _group(c)["weights"].update(strategy="tensor"), "8-bit weights with strategy 'tensor'"),
        (
            lambda c: _group(c).update(input_activations={"num_bits": 8}),
            "activation or KV-cache quantization",
        ),
    ],
)
def test_an_unsupported_quantization_config_is_named(edit, needle, folders, tmp_path):
    folder = _edited(folders["int8"], tmp_path, edit)
    with pytest.raises(UnsupportedModelError, match="quantization_config is not supported") as info:
        LLM(folder, enforce_eager=True)
    assert needle in str(info.value)


def test_a_quantized_checkpoint_is_not_quantized_again(folders):
    with pytest.raises(ValueError, match="already quantized"):
        LLM(str(folders["int4"]), enforce_eager=True, quantization="int8")


@pytest.mark.slow
def test_a_compiled_engine_warm_starts_from_the_checkpoints_integers(folders, tmp_path):
    # The quantized constants' recipes read the checkpoint's integers off the model on a warm start.
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    options = dict(
        dtype="float32", cache_dir=str(tmp_path), compile_policy="ahead", compile_buckets=(1, 8, 64)
    )
    results = []
    for _ in range(2):  # cold, then warm from the cache
        llm = LLM(str(folders["int4"]), **options)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.close()
    eager = LLM(str(folders["int4"]), dtype="float32", enforce_eager=True).generate(
        prompts, params, use_tqdm=False
    )
    assert results[0] == results[1] == [o.outputs[0].token_ids for o in eager]
