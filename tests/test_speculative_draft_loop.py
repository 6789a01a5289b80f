"""The draft model's own tight loop (worker/draft_decoder.py, worker/draft_loop_proposer.py).

Its math against transformers' own model (Llama, Qwen2's biases, Qwen3's q/k norms), eagerly:
each proposal is transformers' greedy next token and q its softmax; a catch-up after a partial
acceptance and a slot lost to another request give the same proposals as a fresh start; sampled
proposals are reproducible per seed and their q reaches the verifier. Each case runs with both
proposal calls: the C++ loop the engine uses on the CPU (kernels/cpu_draft_decoder.cpp, where
it builds) and the torch function; the compiled call is that function under Inductor
(`test_the_compiled_call_proposes_what_the_eager_one_does`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from compiled_engine import LLM, SamplingParams
from compiled_engine.kernels import cpu_draft_decoder, cpu_gemv
from compiled_engine.records.draft_proposer import DraftSampling
from compiled_engine.worker.draft_decoder import DraftDecoder, supports
from compiled_engine.worker.draft_loop_proposer import DraftLoopProposer
from tests.model_factory import make_tiny_model

CPU = torch.device("cpu")
K = 4


def _greedy_continuation(model, tokens: list[int], count: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy next `count` tokens after `tokens`, and the softmax before each."""
    out, dists = [], []
    seq = list(tokens)
    with torch.inference_mode():
        for _ in range(count):
            logits = model(torch.tensor([seq])).logits[0, -1]
            dists.append(logits.softmax(-1))
            seq.append(int(logits.argmax()))
            out.append(seq[-1])
    return out, dists


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(
        tmp_path_factory.mktemp(f"draft-loop-{request.param}"),
        request.param,
        with_tokenizer=False,
        init_std=0.3,  # peaked enough that argmax ties do not happen
    )
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(params=["native", "torch"])
def native(request) -> bool:
    if request.param == "native" and not cpu_draft_decoder.available():
        pytest.skip("no C++ compiler here")
    return request.param == "native"


def _proposer(model, native: bool, num_slots: int = 2) -> DraftLoopProposer:
    decoder = DraftDecoder(model, num_slots, 64, K, CPU, compiled=False, native=native)
    return DraftLoopProposer(decoder, num_slots, 8, seed=0)


def test_proposals_are_transformers_greedy_tokens_and_q_its_softmax(tiny, native):
    assert supports(tiny, 64)
    proposer = _proposer(tiny, native)
    prompt = np.array([1, 17, 42, 99, 5, 61, 23, 7, 88, 14, 3], dtype=np.int64)  # > one chunk of 8
    expected, dists = _greedy_continuation(tiny, prompt.tolist(), K)
    proposal = proposer.propose("a", prompt, (), K, DraftSampling())
    assert list(proposal.token_ids) == expected and proposal.probs is None
    sampled = proposer.propose("b", prompt, (), K, DraftSampling(temperature=1.0, seed=3))
    # Drawn proposals: q of the first is the softmax after the prompt (later ones follow the draws).
    assert sampled.probs is not None and sampled.probs.shape == (K, tiny.config.vocab_size)
    assert np.allclose(sampled.probs[0], dists[0].numpy(), atol=1e-5)


def test_catch_up_after_a_partial_acceptance_and_after_losing_the_slot(tiny, native):
    proposer = _proposer(tiny, native, num_slots=1)
    prompt = np.array([1, 17, 42, 99, 5], dtype=np.int64)
    first = proposer.propose("a", prompt, (), K, DraftSampling()).token_ids
    # The target kept two proposals and emitted another token than the third.
    grown = np.concatenate((prompt, np.array([*first[:2], (first[2] + 1) % 300], dtype=np.int64)))
    expected, _ = _greedy_continuation(tiny, grown.tolist(), K)
    assert list(proposer.propose("a", grown, (), K, DraftSampling()).token_ids) == expected
    # All kept: the last proposal (never fed) and the bonus token are new to the draft.
    grown2 = np.concatenate((grown, np.array([*expected, 9], dtype=np.int64)))
    expected2, _ = _greedy_continuation(tiny, grown2.tolist(), 2)
    assert list(proposer.propose("a", grown2, (), 2, DraftSampling()).token_ids) == expected2
    # One slot: "b" takes it, so "a" starts over, with the same proposals.
    proposer.propose("b", np.array([1, 5, 9], dtype=np.int64), (), K, DraftSampling())
    assert list(proposer.propose("a", grown2, (), 2, DraftSampling()).token_ids) == expected2
    proposer.forget(("a", "b"))
    # A one-token sequence.
    expected3, _ = _greedy_continuation(tiny, [1], K)
    assert (
        list(proposer.propose("c", np.array([1], dtype=np.int64), (), K, DraftSampling()).token_ids)
        == expected3
    )


def test_seeded_draws_repeat_and_differ_between_seeds(tiny, native):
    proposer = _proposer(tiny, native)
    prompt = np.array([1, 17, 42, 99, 5], dtype=np.int64)
    draws = [proposer.propose("a", prompt, (), K, DraftSampling(5.0, seed, 0)).token_ids for seed in range(6)]
    again = [proposer.propose("a", prompt, (), K, DraftSampling(5.0, seed, 0)).token_ids for seed in range(6)]
    assert draws == again
    assert len(set(draws)) > 1  # temperature 5 on a random model: the seeds draw different runs


def test_asking_for_more_proposals_than_k_is_an_error(tiny, native):
    with pytest.raises(ValueError, match="asked for 5 proposals; the draft makes 1 to 4"):
        _proposer(tiny, native).propose("a", np.array([1, 2], dtype=np.int64), (), 5, DraftSampling())


def test_a_bfloat16_prefill_writes_the_float32_ones_kv_to_bfloat16_precision(tiny):
    """A bfloat16 draft prefills in bfloat16 where the CPU multiplies it natively: the k/v it
    writes (a first chunk's, under SDPA's causal mode, and a catch-up chunk's, which attends over
    the cache) are the float32 prefill's, to bfloat16's precision."""
    model = AutoModelForCausalLM.from_config(tiny.config, dtype=torch.bfloat16).eval()
    model.load_state_dict({name: t.to(torch.bfloat16) for name, t in tiny.state_dict().items()})
    native_bf16 = cpu_gemv.best_isa() >= cpu_gemv.ISA_AVX512_BF16
    assert DraftDecoder(model, 1, 64, K, CPU, compiled=False, native=False).prefill_dtype == (
        torch.bfloat16 if native_bf16 else torch.float32
    )
    assert DraftDecoder(tiny, 1, 64, K, CPU, compiled=False, native=False).prefill_dtype == torch.float32
    decoders = {
        dtype: DraftDecoder(model, 1, 64, K, CPU, compiled=False, native=False, prefill_dtype=dtype)
        for dtype in (torch.bfloat16, torch.float32)
    }
    tokens = torch.tensor([1, 17, 42, 99, 5, 61, 23, 7, 88, 14, 3])
    for decoder in decoders.values():
        decoder.prefill(0, tokens[:7], 0)
        decoder.prefill(0, tokens[7:], 7)
    low, full = decoders[torch.bfloat16], decoders[torch.float32]
    for got, want in ((low.k_cache, full.k_cache), (low.v_cache, full.v_cache)):
        assert got.dtype == torch.float32 and bool(want[:, 0, :11].abs().amax() > 0.1)
        scale = float(want[:, 0, :11].abs().amax())
        torch.testing.assert_close(got[:, 0, :11], want[:, 0, :11], atol=0.04 * scale, rtol=0.05)
        assert not got[:, 0, 11:].any()  # nothing past the chunks


@pytest.mark.slow  # one Inductor compile (tens of seconds here)
def test_the_compiled_call_proposes_what_the_eager_one_does(tiny):
    prompt = np.array([1, 17, 42, 99, 5, 61, 23], dtype=np.int64)
    eager = _proposer(tiny, native=False).propose("a", prompt, (), K, DraftSampling())
    compiled = DraftLoopProposer(DraftDecoder(tiny, 2, 64, K, CPU, compiled=True, native=False), 2, 8, seed=0)
    assert compiled.propose("a", prompt, (), K, DraftSampling()) == eager


def test_sampled_requests_send_the_drafts_q_to_the_verifier(llama_dir, tmp_path):
    """End to end at temperature 1: the draft draws its proposals and the runner gets their q
    (ScheduledRequest.draft_probs); seeded outputs repeat."""
    from tests.test_speculative_draft_model import draft, truncated_draft

    draft_dir = truncated_draft(llama_dir, tmp_path / "draft")
    llm = LLM(
        llama_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        speculative_config=draft(draft_dir, 3),
    )
    seen: list[np.ndarray] = []
    runner = llm.engine.model_runner
    launch = runner.launch

    def spy(step):
        seen.extend(s.draft_probs for s in step.scheduled if s.draft_probs is not None)
        return launch(step)

    runner.launch = spy
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=s) for s in range(4)]
    prompts = [{"prompt_token_ids": [1, 17, 42, 99, 5]}] * 4
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == again
    assert seen and all(np.allclose(q.sum(-1), 1.0, atol=1e-4) for q in seen)
    stats = llm.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
