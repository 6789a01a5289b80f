"""Host cost of the detokenizer per decode step of 64 requests: the Rust decoder vs transformers' decode.

Each round streams 64 requests' outputs (64 tokens each of real Python source, the embedded
model's tokenizer) through IncrementalDetokenizer one token per request per step, as the
engine's output processor does every step. "rust": the tokenizer backend's own decode (the
default where it returns what transformers would, engine/detokenizer.py `backend_decoder`);
"transformers": `tokenizer.decode`, the path before. Both must give the same text.

    python -m pytest bench/test_detokenize.py -q --benchmark-columns=median,min,rounds
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from compiled_engine.default_model_path import default_model_dir
from compiled_engine.engine import detokenizer
from compiled_engine.engine.detokenizer import IncrementalDetokenizer

NUM_REQUESTS = 64
NUM_STEPS = 64
PROMPT_TOKENS = 8


@pytest.mark.parametrize("decoder", ["rust", "transformers"])
def test_detokenize_64_requests(benchmark, monkeypatch, decoder):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    if decoder == "transformers":
        monkeypatch.setattr(detokenizer, "backend_decoder", lambda tokenizer: None)
    else:
        assert detokenizer.backend_decoder(tokenizer) is not None
    ids = tokenizer.encode(Path(detokenizer.__file__).read_text(), add_special_tokens=False)
    span = PROMPT_TOKENS + NUM_STEPS
    starts = [(i * 97) % (len(ids) - span) for i in range(NUM_REQUESTS)]
    requests = [(ids[s : s + PROMPT_TOKENS], ids[s + PROMPT_TOKENS : s + span]) for s in starts]

    def run() -> list[str]:
        detoks = [IncrementalDetokenizer(tokenizer, prompt) for prompt, _ in requests]
        texts = [""] * NUM_REQUESTS
        for step in range(NUM_STEPS):
            for i, (detok, (_, output)) in enumerate(zip(detoks, requests, strict=True)):
                texts[i] += detok.append([output[step]])
        return [text + detok.flush() for text, detok in zip(texts, detoks, strict=True)]

    benchmark.group = f"detokenize {NUM_REQUESTS} requests x {NUM_STEPS} steps"
    texts = benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=1)
    assert texts == [tokenizer.decode(output, skip_special_tokens=True) for _, output in requests]
    benchmark.extra_info.update(decoder=decoder, requests=NUM_REQUESTS, steps=NUM_STEPS)
