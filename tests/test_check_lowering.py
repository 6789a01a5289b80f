"""Attention that was not lowered to the paged op is refused loudly, naming model, node and line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from compiled_engine.errors import LoweringError
from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.passes.check_lowering import CheckLowering
from tests.test_capture import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, PagedBatch, make_model
from tests.test_lower_sdpa import NUM_HEADS, TinyDecoder, repeat_kv


def explicit_softmax_attention(q, k, v, scale):
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    t = q.shape[2]
    mask = torch.full((t, t), float("-inf"), device=q.device).triu(1)
    weights = torch.softmax(q @ k.transpose(-2, -1) * scale + mask, dim=-1)
    return weights @ v


def tiled_heads_sdpa(q, k, v, scale):
    # `repeat` tiles heads (q head h gets kv head h % Hkv), unlike repeat_kv (h // n_rep):
    # the pass must not mistake it for GQA.
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat(1, n_rep, 1, 1), v.repeat(1, n_rep, 1, 1), is_causal=True
    )


def bidirectional_sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


class ExplicitSoftmaxLM(TinyDecoder):
    def __init__(self) -> None:
        super().__init__(explicit_softmax_attention)


class TiledHeadsLM(TinyDecoder):
    def __init__(self) -> None:
        super().__init__(tiled_heads_sdpa)


class BidirectionalLM(TinyDecoder):
    def __init__(self) -> None:
        super().__init__(bidirectional_sdpa)


def capture_and_run(model: nn.Module, num_caches: int = NUM_LAYERS) -> None:
    paged = PagedBatch()
    captured = capture_model(model, paged.kv_caches(num_caches, NUM_KV_HEADS, HEAD_DIM))
    captured(paged.step([(0, torch.arange(5), 0)]))


def test_explicit_softmax_attention_is_rejected_with_model_node_and_line() -> None:
    with pytest.raises(LoweringError) as caught:
        capture_and_run(ExplicitSoftmaxLM())
    message = str(caught.value)
    assert message.startswith("ExplicitSoftmaxLM: ")
    assert "softmax over q·kᵀ scores" in message
    assert "node 'weights' " in message and "node 'weights_1' " in message  # one per layer
    assert "test_check_lowering.py" in message and "torch.softmax(q @ k.transpose(-2, -1)" in message


def test_sdpa_with_unrecognised_head_repetition_is_rejected() -> None:
    assert NUM_HEADS != NUM_KV_HEADS  # with no GQA, tiling would be harmless
    with pytest.raises(LoweringError) as caught:
        capture_and_run(TiledHeadsLM())
    message = str(caught.value)
    assert message.startswith("TiledHeadsLM: ")
    assert "node 'attended' (call_function scaled_dot_product_attention)" in message
    assert "in tiled_heads_sdpa | return F.scaled_dot_product_attention(" in message
    assert "lower_sdpa: key has 4 heads after undoing repeat_kv, but the KV cache holds 2" in message


def test_bidirectional_sdpa_is_rejected() -> None:
    with pytest.raises(
        LoweringError, match="BidirectionalLM: (.|\n)*lower_sdpa: no mask and is_causal=False"
    ):
        capture_and_run(BidirectionalLM())


def test_attention_layer_count_must_match_the_kv_caches() -> None:
    with pytest.raises(
        LoweringError, match="LlamaForCausalLM: .* 2 paged-attention calls but .* 3 attention layers"
    ):
        capture_and_run(make_model("llama"), num_caches=3)


class EinsumAttention(nn.Module):
    def forward(self, q, k, v):
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / 4.0
        return scores.float().softmax(-1) @ v


class Router(nn.Module):
    """A softmax over a projection of one activation (an MoE router), not attention."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.centroids = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        return F.softmax(self.gate(x), dim=-1) + torch.softmax(x @ self.centroids, dim=-1)


class FusedFlash(nn.Module):
    def forward(self, q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]


def test_einsum_attention_in_a_plain_fx_graph_is_rejected() -> None:
    gm = fx.symbolic_trace(EinsumAttention())
    with pytest.raises(LoweringError, match="EinsumAttention: (.|\n)*'softmax'.*scores from 'einsum'"):
        CheckLowering("EinsumAttention")(gm)


def test_fused_attention_kernel_is_rejected() -> None:
    gm = fx.symbolic_trace(FusedFlash())
    with pytest.raises(LoweringError, match="FusedFlash: (.|\n)*fused attention kernel"):
        CheckLowering("FusedFlash")(gm)


def test_softmax_that_is_not_attention_passes() -> None:
    gm = fx.symbolic_trace(Router())
    result = CheckLowering("Router")(gm)
    assert result.pass_name == "check_lowering" and result.nodes_rewritten == 0


def test_lowered_hf_graph_passes_with_expected_count() -> None:
    paged = PagedBatch()
    captured = capture_model(make_model("qwen3"), paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    captured(paged.step([(0, torch.arange(5), 0)]))
    report = captured.pass_log[0].result("check_lowering")
    assert report.nodes_rewritten == NUM_LAYERS
    # Counting the graph's attention against a wrong layer count fails on the same graph.
    with pytest.raises(LoweringError, match="Qwen3ForCausalLM: .* 2 paged-attention calls but .* 4"):
        CheckLowering("Qwen3ForCausalLM", 4)(captured.graphs[0])
