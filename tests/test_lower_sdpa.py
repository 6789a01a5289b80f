"""Route (b): a model that calls SDPA itself is captured, rewritten to the paged op, and still right."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compiled_engine.graphs.capture import CapturedModel, capture_model, default_pass_manager
from compiled_engine.graphs.pass_manager import PassManager
from compiled_engine.graphs.passes.dce import DeadCodeElimination
from compiled_engine.graphs.passes.lower_sdpa import PAGED_ATTENTION_TARGETS, SDPA_TARGETS, LowerSdpa
from compiled_engine.graphs.step_inputs import anchor_step_metadata
from tests import test_capture as hf
from tests.test_capture import PagedBatch, count_nodes, eager_logits, make_model

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = hf.NUM_LAYERS, 4, hf.NUM_KV_HEADS, 8
VOCAB = 64
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF's GQA head repetition: [B, Hkv, T, D] -> [B, Hkv * n_rep, T, D], head h uses kv head h // n_rep."""
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def repeat_kv_with_causal_mask(q, k, v, scale):
    n_rep = q.shape[1] // k.shape[1]
    t = q.shape[2]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(
        q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask, scale=scale
    )


def gqa_is_causal(q, k, v, scale):
    # No repetition, no mask, default scale: SDPA's own GQA and causal flag.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def unsqueeze_repeat_with_float_mask(q, k, v, scale):
    n_rep = q.shape[1] // k.shape[1]
    t = q.shape[2]
    mask = torch.full((t, t), float("-inf"), device=q.device).triu(1)
    k = k.unsqueeze(2).expand(-1, -1, n_rep, -1, -1).reshape(q.shape)
    v = v.unsqueeze(2).expand(-1, -1, n_rep, -1, -1).reshape(q.shape)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=scale)


class LMOutput(NamedTuple):
    logits: torch.Tensor


class TinyDecoder(nn.Module):
    """A minimal non-HF decoder with HF's calling convention and a pluggable attention."""

    def __init__(self, attention: Attention, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        hidden = NUM_HEADS * HEAD_DIM
        self.attention = attention
        self.embed = nn.Embedding(VOCAB, hidden)
        self.position_embed = nn.Embedding(64, hidden)
        self.q_proj = nn.ModuleList(nn.Linear(hidden, NUM_HEADS * HEAD_DIM) for _ in range(NUM_LAYERS))
        self.k_proj = nn.ModuleList(nn.Linear(hidden, NUM_KV_HEADS * HEAD_DIM) for _ in range(NUM_LAYERS))
        self.v_proj = nn.ModuleList(nn.Linear(hidden, NUM_KV_HEADS * HEAD_DIM) for _ in range(NUM_LAYERS))
        self.o_proj = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(NUM_LAYERS))
        self.lm_head = nn.Linear(hidden, VOCAB)
        self.scale = 0.7 / math.sqrt(HEAD_DIM)  # not the default, so a dropped scale shows

    def forward(self, input_ids, position_ids, logits_to_keep, use_cache=False, **kwargs):
        x = self.embed(input_ids) + self.position_embed(position_ids)
        t = x.shape[1]
        for q_proj, k_proj, v_proj, o_proj in zip(
            self.q_proj, self.k_proj, self.v_proj, self.o_proj, strict=True
        ):
            q = q_proj(x).view(1, t, NUM_HEADS, HEAD_DIM).transpose(1, 2)
            k = k_proj(x).view(1, t, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = v_proj(x).view(1, t, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
            attended = self.attention(q, k, v, self.scale)
            x = x + o_proj(attended.transpose(1, 2).reshape(1, t, -1))
        return LMOutput(logits=self.lm_head(torch.tanh(x[:, logits_to_keep])))


def own_eager_logits(model: TinyDecoder, tokens: torch.Tensor) -> torch.Tensor:
    t = len(tokens)
    with torch.no_grad():
        return model(tokens[None], torch.arange(t)[None], torch.arange(t)).logits[0]


@pytest.mark.parametrize(
    "attention", [repeat_kv_with_causal_mask, gqa_is_causal, unsqueeze_repeat_with_float_mask]
)
def test_sdpa_model_is_rewritten_and_matches_its_eager_output(attention: Attention) -> None:
    model = TinyDecoder(attention)
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, VOCAB, (n,), generator=generator) for n in (9, 7)]
    references = [own_eager_logits(model, seq) for seq in sequences]
    paged = PagedBatch()
    captured = capture_model(model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))

    # Packed prefill: the model's own mask knows nothing of sequences, the paged op does.
    got = captured(paged.step([(0, sequences[0][:6], 0), (1, sequences[1][:5], 0)]))
    torch.testing.assert_close(got, torch.cat([references[0][:6], references[1][:5]]), atol=1e-5, rtol=0)
    for position in (6, 7, 8):  # decode sequence 0 from the cache
        got = captured(paged.step([(0, sequences[0][position : position + 1], position)]))
        torch.testing.assert_close(got, references[0][position : position + 1], atol=1e-5, rtol=0)

    for gm, report in zip(captured.graphs, captured.pass_log, strict=True):
        assert report.result("lower_sdpa").nodes_rewritten == NUM_LAYERS
        assert count_nodes(gm, PAGED_ATTENTION_TARGETS) == NUM_LAYERS
        assert count_nodes(gm, SDPA_TARGETS) == 0
        # The causal mask lost its only user (SDPA) and was eliminated with it.
        assert not any(n.target in ("tril", "triu") for n in gm.graph.nodes)


def test_scale_that_dynamo_made_a_graph_node_is_passed_through() -> None:
    """Without specialize_float, Dynamo turns a float attribute into a tensor read by .item()."""
    model = TinyDecoder(repeat_kv_with_causal_mask)
    tokens = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(4))
    reference = own_eager_logits(model, tokens)
    paged = PagedBatch()
    kv_caches = paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM)
    for cache in kv_caches:
        torch._dynamo.mark_static(cache)  # as capture_model does: the pass checks their head count
    graphs = []

    def backend(gm, example_inputs):
        PassManager([LowerSdpa(), DeadCodeElimination()])(gm)
        graphs.append(gm)
        return gm.forward

    def step(inputs, kv_caches):
        anchor_step_metadata(inputs, kv_caches)
        return model(inputs.input_ids, inputs.positions, inputs.logits_indices).logits[0]

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(specialize_float=False), torch.no_grad():
        got = compiled(paged.step([(0, tokens, 0)]), kv_caches)
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)
    scales = [n.args[8] for n in graphs[0].graph.nodes if n.target in PAGED_ATTENTION_TARGETS]
    assert len(scales) == NUM_LAYERS and all(isinstance(s, torch.fx.Node) for s in scales)


def test_pass_without_sdpa_is_a_no_op() -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    before = gm.code
    result = LowerSdpa()(gm)
    assert result.nodes_rewritten == 0 and result.notes == ()
    assert gm.code == before


def test_hf_model_left_on_sdpa_is_lowered_by_the_pass() -> None:
    """An HF model that cannot switch attention implementation falls back to this pass."""
    model = make_model("qwen3")
    model.set_attn_implementation("sdpa")
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, hf.VOCAB, (n,), generator=generator) for n in (8, 6)]
    references = [eager_logits(model, seq) for seq in sequences]
    paged = PagedBatch()
    # Built directly, as capture_model would switch the model to the AttentionInterface route.
    captured = CapturedModel(
        model,
        paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, hf.HEAD_DIM),
        default_pass_manager("Qwen3ForCausalLM", 2),
    )
    got = captured(paged.step([(0, sequences[0][:5], 0), (1, sequences[1], 0)]))
    torch.testing.assert_close(got, torch.cat([references[0][:5], references[1]]), atol=1e-5, rtol=0)
    got = captured(paged.step([(0, sequences[0][5:6], 5)]))
    torch.testing.assert_close(got, references[0][5:6], atol=1e-5, rtol=0)
    assert [r.result("lower_sdpa").nodes_rewritten for r in captured.pass_log] == [NUM_LAYERS, NUM_LAYERS]
