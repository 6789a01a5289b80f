"""Embeddings/s: our pooling engine vs `SentenceTransformer.encode`, same folder, same texts, same run.

A random Qwen3-shaped sentence-transformers folder (last-token pooling, normalized; saved by
sentence-transformers itself) embeds 64 and 256 inputs of mixed lengths (8-512 tokens, seeded).
Ours: the compiled pooling engine (compile and Dynamo traces happen in an untimed warm-up call);
theirs: `encode` with its default batch size (32), which pads each batch to its longest input.
Both fp32 on the same threads. The figure is inputs per second (median of the measured rounds).

    python -m pytest bench/test_embeddings.py -p no:cacheprovider -q --benchmark-json=emb.json
"""

from __future__ import annotations

import random
import statistics
import time

import pytest
import torch

from bench.workloads import BenchSizes
from tests.embedding_models import Normalize, Pooling, SentenceTransformer, Transformer
from tests.model_factory import build_tokenizer, make_tiny_model

# (inputs, length range) per bench profile; smoke only checks that both sides run.
_WORKLOADS = {"full": ((64, 256), (8, 512)), "quick": ((64,), (8, 256)), "smoke": ((8,), (8, 32))}
_ROUNDS = {"full": 3, "quick": 2, "smoke": 1}
_BODY = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1536)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-embed")
    body = make_tiny_model(tmp, "qwen3", seed=0, max_position_embeddings=1024, init_std=0.02, **_BODY)
    modules = [Transformer(str(body)), Pooling(_BODY["hidden_size"], pooling_mode="lasttoken"), Normalize()]
    out = tmp / "st"
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def _texts(count: int, length_range: tuple[int, int], seed: int = 0) -> list[str]:
    """Texts of seeded token lengths in `length_range` (re-tokenised: lengths are approximate)."""
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    vocab = [t for t in range(3, tokenizer.vocab_size)]
    texts = []
    for _ in range(count):
        ids = [rng.choice(vocab) for _ in range(rng.randint(*length_range) - 1)]
        texts.append(tokenizer.decode(ids))
    return texts


def _profile(sizes: BenchSizes) -> str:
    return sizes.profile if sizes.profile in _WORKLOADS else "full"


@pytest.fixture(scope="module")
def engines(folder):
    from compiled_engine import LLM

    ours = LLM(model=str(folder), device="cpu", max_model_len=1024, max_num_batched_tokens=8192)
    theirs = SentenceTransformer(str(folder), device="cpu")
    return ours, theirs


@pytest.mark.parametrize("which", ["first", "second"])
def test_embeddings_throughput(benchmark, sizes, engines, which):
    profile = _profile(sizes)
    counts, length_range = _WORKLOADS[profile]
    if which == "second" and len(counts) < 2:
        pytest.skip(f"the {profile} profile has one input count")
    count = counts[0 if which == "first" else 1]
    ours, theirs = engines
    texts = _texts(count, length_range)
    lengths = [len(ids) for ids in ours.get_tokenizer()(texts)["input_ids"]]
    # Untimed warm-up of both: compiles and traces every shape this workload meets (ours).
    ours.embed(texts, use_tqdm=False)
    theirs.encode(texts[:32])
    rounds = _ROUNDS[profile]
    times = {"ours": [], "sentence-transformers": []}
    last = {}
    for _ in range(rounds):
        start = time.perf_counter()
        last["ours"] = ours.embed(texts, use_tqdm=False)
        times["ours"].append(time.perf_counter() - start)
        start = time.perf_counter()
        last["st"] = theirs.encode(texts, convert_to_tensor=True)
        times["sentence-transformers"].append(time.perf_counter() - start)
    got = torch.tensor([o.outputs.embedding for o in last["ours"]])
    cosine = torch.nn.functional.cosine_similarity(got, last["st"].float(), dim=-1)
    assert bool((cosine > 0.9999).all()), cosine.min()
    per_s = {name: count / statistics.median(ts) for name, ts in times.items()}
    benchmark.extra_info.update(
        workload="embeddings",
        inputs=count,
        tokens=sum(lengths),
        length_range=list(length_range),
        embeddings_per_s=per_s,
        speedup=per_s["ours"] / per_s["sentence-transformers"],
    )
    print(
        f"\nembeddings: {count} inputs, {sum(lengths)} tokens: ours {per_s['ours']:.1f}/s, "
        f"sentence-transformers {per_s['sentence-transformers']:.1f}/s, "
        f"{per_s['ours'] / per_s['sentence-transformers']:.2f}x"
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
