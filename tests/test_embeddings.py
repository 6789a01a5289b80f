"""Embedding models (`LLM(runner="pooling")`, `llm.embed`) against sentence-transformers' own encode.

Every folder is a tiny random model saved by sentence-transformers itself (tests/embedding_models.py);
the reference is `SentenceTransformer(folder).encode` on the same texts. Eager engines for most cases
(capture and lowering are the same as compiled), one compiled case.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer

from compiled_engine import LLM
from compiled_engine.errors import ModelLoadError, UnsupportedModelError
from compiled_engine.pooling.step_packing import pack_steps
from compiled_engine.pooling_params import PoolingParams
from tests.embedding_models import PACKED, TEXTS, make_sentence_transformers_folder

COSINE = 0.99999


def reference(folder, texts, **kwargs) -> torch.Tensor:
    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_tensor=True, **kwargs).float()


def embeddings(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def assert_parity(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    cosine = F.cosine_similarity(got, want, dim=-1)
    assert bool((cosine >= COSINE).all()), cosine
    # The length too (normalized or not), not only the direction.
    torch.testing.assert_close(got.norm(dim=-1), want.norm(dim=-1), rtol=1e-4, atol=1e-5)


@pytest.fixture
def qwen3_folder(st_qwen3_folder):
    return st_qwen3_folder


@pytest.fixture
def qwen3_llm(st_qwen3_llm):
    return st_qwen3_llm


def test_qwen3_last_token_matches_sentence_transformers_single_and_batched(qwen3_folder, qwen3_llm):
    want = reference(qwen3_folder, TEXTS)
    batched = qwen3_llm.embed(TEXTS)
    assert_parity(embeddings(batched), want)
    single = [qwen3_llm.embed(text)[0] for text in TEXTS]
    assert_parity(embeddings(single), want)
    tokenizer = qwen3_llm.get_tokenizer()
    assert batched[2].prompt_token_ids == tokenizer(TEXTS[2])["input_ids"]
    assert all(isinstance(v, float) for v in batched[0].outputs.embedding)


def test_packing_keeps_each_step_under_the_budget():
    assert pack_steps([4, 17, 106, 36, 49, 2, 93], token_budget=120, max_seqs=3) == [
        [0, 1],
        [2],
        [3, 4, 5],
        [6],
    ]
    assert pack_steps([5, 5, 5, 5], token_budget=100, max_seqs=2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="more than a step's 8"):
        pack_steps([4, 9], token_budget=8, max_seqs=4)


# Slow (the default run's budget: each case builds and traces an engine); the default run covers MEAN
# on this body through test_pooler_config_overrides_the_folder, CLS through the RoBERTa case.
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mean", "cls"])
def test_mean_and_cls_pooling_match_sentence_transformers(tmp_path, mode):
    folder = make_sentence_transformers_folder(tmp_path, "qwen3", mode, normalize=False, seed=3)
    llm = LLM(model=str(folder), runner="pooling", device="cpu", enforce_eager=True, **PACKED)
    assert_parity(embeddings(llm.embed(TEXTS)), reference(folder, TEXTS))


# Slow: a cold Inductor compile of the body costs 20-40 s here, the default run's whole budget.
@pytest.mark.slow
def test_compiled_engine_matches_sentence_transformers(qwen3_folder):
    llm = LLM(model=str(qwen3_folder), device="cpu", **PACKED)
    assert_parity(embeddings(llm.embed(TEXTS[:4])), reference(qwen3_folder, TEXTS[:4]))


def test_pooler_config_overrides_the_folder(tmp_path, qwen3_folder):
    # Same seed, same body weights: the lasttoken folder pooled as MEAN without normalization is
    # the mean folder's raw output.
    mean_folder = make_sentence_transformers_folder(tmp_path, "qwen3", "mean", normalize=False)
    llm = LLM(
        model=str(qwen3_folder),
        device="cpu",
        enforce_eager=True,
        pooler_config={"pooling_type": "MEAN", "normalize": False},
        **PACKED,
    )
    assert_parity(embeddings(llm.embed(TEXTS[:3])), reference(mean_folder, TEXTS[:3]))


def test_dimensions_truncate_then_normalize(tmp_path, qwen3_llm):
    # Same seed, same body: the folder without its Normalize module gives the raw pooled vectors.
    raw = reference(
        make_sentence_transformers_folder(tmp_path, "qwen3", "lasttoken", normalize=False), TEXTS[:3]
    )
    got = embeddings(qwen3_llm.embed(TEXTS[:3], PoolingParams(dimensions=16)))
    assert_parity(got, F.normalize(raw[:, :16], dim=-1))
    unnormalized = embeddings(qwen3_llm.embed(TEXTS[:3], PoolingParams(dimensions=16, normalize=False)))
    assert_parity(unnormalized, raw[:, :16])


def test_token_id_prompts_and_truncation(qwen3_llm):
    tokenizer = qwen3_llm.get_tokenizer()
    ids = tokenizer(TEXTS[2])["input_ids"]
    by_text = embeddings(qwen3_llm.embed(TEXTS[2]))
    assert_parity(embeddings(qwen3_llm.embed([ids])), by_text)
    assert_parity(embeddings(qwen3_llm.embed({"prompt_token_ids": ids})), by_text)
    long_ids = ids * 2  # 212 tokens: more than max_model_len=128
    with pytest.raises(ValueError, match="212 tokens, more than the model's 128; set truncate_prompt_tokens"):
        qwen3_llm.embed([long_ids])
    kept = qwen3_llm.embed([long_ids], truncate_prompt_tokens=100)[0]
    assert kept.prompt_token_ids == long_ids[-100:]
    assert_parity(embeddings([kept]), embeddings(qwen3_llm.embed([long_ids[-100:]])))


def test_bad_input_is_a_clear_error_and_the_engine_keeps_working(qwen3_llm):
    with pytest.raises(ValueError, match="the input is empty"):
        qwen3_llm.embed([""])
    with pytest.raises(ValueError, match="the input is empty"):
        qwen3_llm.embed([[]])
    with pytest.raises(
        ValueError, match="dimensions=65 is more than the model gives: its embeddings have 64 values"
    ):
        qwen3_llm.embed(["a"], PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="dimensions must be a positive int"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="token id 999 is not in the model's vocabulary"):
        qwen3_llm.embed([[1, 999]])
    with pytest.raises(ValueError, match="needs a generation model; this one is a pooling model"):
        qwen3_llm.generate(["a"])
    assert len(qwen3_llm.embed(["still serving"])[0].outputs.embedding) == 64


def test_unsupported_pooling_type_is_refused(tmp_path, qwen3_folder):
    with pytest.raises(ValueError, match="pooling_type 'MAX' is not supported: choose one of LAST, MEAN"):
        LLM(model=str(qwen3_folder), pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match=r"pooler_config has unknown field\(s\) \['pooling'\]"):
        LLM(model=str(qwen3_folder), pooler_config={"pooling": "MEAN"})
    max_folder = make_sentence_transformers_folder(tmp_path, "qwen3", "max")
    with pytest.raises(UnsupportedModelError, match="pooling mode 'max' is not supported"):
        LLM(model=str(max_folder), device="cpu", enforce_eager=True)


def test_a_generation_folder_is_not_a_pooling_model(llama_dir):
    with pytest.raises(
        ModelLoadError, match="not a pooling model: it has no sentence-transformers modules.json"
    ):
        LLM(model=str(llama_dir), runner="pooling", device="cpu", enforce_eager=True)
    with pytest.raises(ValueError, match="unknown runner 'embed'"):
        LLM(model=str(llama_dir), runner="embed")


# Encoder bodies: bidirectional attention (the op's causal=False), absolute positions (RoBERTa's
# offset past padding_idx), token type ids left at zero. RoBERTa with CLS in the default run (the
# position offset and bidirectional attention both matter there); the other pairs are slow.
@pytest.mark.parametrize(
    ("arch", "mode"),
    [
        ("roberta", "cls"),
        pytest.param("bert", "mean", marks=pytest.mark.slow),
        pytest.param("bert", "cls", marks=pytest.mark.slow),
        pytest.param("roberta", "mean", marks=pytest.mark.slow),
    ],
)
def test_encoder_bodies_match_sentence_transformers(tmp_path, arch, mode):
    folder = make_sentence_transformers_folder(tmp_path, arch, mode, seed=5)
    llm = LLM(model=str(folder), device="cpu", enforce_eager=True, **PACKED)
    want = reference(folder, TEXTS)
    assert_parity(embeddings(llm.embed(TEXTS)), want)
    assert_parity(embeddings([llm.embed(TEXTS[2])[0]]), want[2:3])


def test_encoder_body_refuses_a_causal_only_backend(tmp_path):
    folder = make_sentence_transformers_folder(tmp_path, "bert", "cls", seed=5)
    with pytest.raises(ValueError, match="attention_backend='cpu' attends causally only"):
        LLM(model=str(folder), device="cpu", enforce_eager=True, attention_backend="cpu")


def test_pooler_config_and_runner_options_are_checked():
    from compiled_engine.engine_args import EngineArgs

    assert EngineArgs(pooler_config='{"pooling_type": "mean"}').pooler_config.pooling_type == "MEAN"
    with pytest.raises(ValueError, match="pooler_config is not valid JSON"):
        EngineArgs(pooler_config="{mean")
    with pytest.raises(ValueError, match="pooler_config normalize must be true or false, got 'yes'"):
        EngineArgs(pooler_config={"normalize": "yes"})
    with pytest.raises(ValueError, match="pooler_config must be a dict"):
        EngineArgs(pooler_config=["MEAN"])
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be a positive int or -1"):
        PoolingParams(truncate_prompt_tokens=0)
