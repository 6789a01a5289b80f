"""The draft's C++ proposal loop (kernels/cpu_draft_decoder.cpp) against its torch function.

The torch function (worker/draft_decoder.py `_propose_eager`) is itself checked against
transformers in tests/test_speculative_draft_loop.py, which runs every case with both. Here: the
same proposals and q from the same cache for Llama, Qwen2's biases and Qwen3's q/k norms, greedy
and sampled (the same noise), float32 and bfloat16 weights, odd sizes, a one-token sequence and
a slot other than the first; and arguments the kernel refuses.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from compiled_engine.kernels import cpu_draft_decoder
from compiled_engine.worker.draft_decoder import DraftDecoder
from tests.model_factory import make_tiny_model

CPU = torch.device("cpu")
K = 3
MAX_LEN = 40

pytestmark = pytest.mark.skipif(not cpu_draft_decoder.available(), reason="no C++ compiler here")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(
        tmp_path_factory.mktemp(f"native-draft-{request.param}"),
        request.param,
        with_tokenizer=False,
        init_std=0.3,  # peaked enough that argmax ties do not happen
        hidden_size=40,  # odd sizes: no multiple of a vector's lanes
        num_heads=4,
        num_kv_heads=2,
        head_dim=10,
        intermediate_size=72,
        vocab_size=301,
    )
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _pair(model, num_slots: int = 2) -> tuple[DraftDecoder, DraftDecoder]:
    """A native and a torch decoder of `model` whose caches hold the same prompt in slot 1."""
    native = DraftDecoder(model, num_slots, MAX_LEN, K, CPU, compiled=False, native=True)
    reference = DraftDecoder(model, num_slots, MAX_LEN, K, CPU, compiled=False, native=False)
    assert native.native is not None and reference.native is None
    prompt = torch.tensor([1, 17, 42, 99, 5, 61, 23, 7, 88, 14, 3])
    for decoder in (native, reference):
        decoder.prefill(1, prompt, 0)
    return native, reference


def _noise(model) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.empty(1, K, model.config.vocab_size).exponential_(generator=generator)


def test_greedy_proposals_match_the_torch_function(tiny):
    native, reference = _pair(tiny)
    for position in (12, 13):  # the second call writes over positions the first fed
        got, got_q = native.propose(1, (3, 64), position, 0.0, None)
        want, _ = reference.propose(1, (3, 64), position, 0.0, None)
        assert got == want and got_q is None
    assert torch.allclose(native.k_cache, reference.k_cache, atol=1e-5)
    assert torch.allclose(native.v_cache, reference.v_cache, atol=1e-5)


def test_sampled_proposals_and_q_match_the_torch_function(tiny):
    native, reference = _pair(tiny)
    noise = _noise(tiny)
    got, got_q = native.propose(1, (3, 64), 12, 0.7, noise)
    want, want_q = reference.propose(1, (3, 64), 12, 0.7, noise)
    assert got == want
    assert got_q is not None and want_q is not None
    assert torch.allclose(got_q, want_q, atol=1e-5)
    assert torch.allclose(got_q.sum(-1), torch.ones(K), atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_head_dims_of_16s_match_the_torch_function(tmp_path, head_dim):
    """Head dims of whole 16-lane vectors take the kernel's register-resident attention (the
    others, as `tiny`'s 10, its plain loops): greedy proposals, sampled ones and q, over more
    than one vector's worth of positions."""
    folder = make_tiny_model(
        tmp_path, "llama", with_tokenizer=False, init_std=0.3, hidden_size=64, num_heads=2,
        num_kv_heads=1, head_dim=head_dim, intermediate_size=72, vocab_size=301,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    native, reference = _pair(model)
    prompt = torch.tensor([5, 9, 200, 31, 77, 3, 18, 250, 6, 41, 12, 90])
    for decoder in (native, reference):
        decoder.prefill(1, prompt, 11)  # positions 0-22 written, so 24+ are attended below
    got, _ = native.propose(1, (3, 64), 24, 0.0, None)
    want, _ = reference.propose(1, (3, 64), 24, 0.0, None)
    assert got == want
    noise = _noise(model)
    got, got_q = native.propose(1, (3, 64), 24, 0.7, noise)
    want, want_q = reference.propose(1, (3, 64), 24, 0.7, noise)
    assert got == want and got_q is not None and want_q is not None
    assert torch.allclose(got_q, want_q, atol=1e-5)


def test_a_one_token_sequence(tiny):
    native, reference = _pair(tiny)
    assert native.propose(0, (9, 9), 0, 0.0, None) == reference.propose(0, (9, 9), 0, 0.0, None)


def test_bfloat16_weights_are_read_as_bfloat16(tiny):
    """A bfloat16 model: the kernel reads its matrices in bfloat16, the same values the torch
    function widens to float32, so the proposals agree."""
    model = AutoModelForCausalLM.from_config(tiny.config, dtype=torch.bfloat16).eval()
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in tiny.state_dict().items()})
    native, reference = _pair(model)
    assert native.native is not None
    assert native.native.weight_dtype == torch.bfloat16
    got, _ = native.propose(1, (3, 64), 12, 0.0, None)
    want, _ = reference.propose(1, (3, 64), 12, 0.0, None)
    assert got == want


def test_arguments_out_of_range_are_refused(tiny):
    native, _ = _pair(tiny)
    model = native.native
    assert model is not None
    cases = [
        dict(slot=2, tokens=(1, 2), first_position=0),  # only slots 0 and 1
        dict(slot=0, tokens=(1, 301), first_position=0),  # a token past the vocabulary
        dict(slot=0, tokens=(1, -1), first_position=0),
        dict(slot=0, tokens=(1, 2), first_position=MAX_LEN - 3),  # proposals would run past the slot
        dict(slot=0, tokens=(), first_position=0),
    ]
    for case in cases:
        with pytest.raises(ValueError, match="draft proposal arguments out of range"):
            model.propose(**case, num_proposals=K, temperature=0.0, noise=None, want_probs=False)
    with pytest.raises(ValueError, match="sampled proposals need contiguous float32 noise"):
        model.propose(0, (1, 2), 0, K, 1.0, None, want_probs=True)
    with pytest.raises(ValueError, match="noise holds"):
        model.propose(0, (1, 2), 0, K, 1.0, torch.ones(K, 5), want_probs=True)


def test_tensors_the_kernel_cannot_read_are_refused(tiny):
    native, _ = _pair(tiny)
    with pytest.raises(ValueError, match="float32 or bfloat16 weights"):
        native._native_model(torch.float16)
    decoder = DraftDecoder(tiny, 1, MAX_LEN, K, CPU, compiled=False, native=False)
    decoder.norm = decoder.norm.to(torch.bfloat16)  # norms are read as float32
    with pytest.raises(ValueError, match="contiguous torch.float32 CPU tensors"):
        decoder._native_model(torch.float32)
