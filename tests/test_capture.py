"""Capture of tiny random HF decoders: every attention is the paged op, logits match HF eager."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from compiled_engine.errors import UnsupportedModelError
from compiled_engine.graphs import capture
from compiled_engine.graphs.capture import capture_model, default_pass_manager
from compiled_engine.graphs.pass_manager import PassManager
from compiled_engine.graphs.passes.check_lowering import CheckLowering
from compiled_engine.graphs.passes.cpu_gemv import CpuGemvLinears
from compiled_engine.graphs.passes.cpu_gemv_quantized import CpuGemmQuantized, CpuGemvQuantized
from compiled_engine.graphs.passes.dce import DeadCodeElimination
from compiled_engine.graphs.passes.gemv_lowering import GemvLowering
from compiled_engine.graphs.passes.inline_attention import InlineAttention
from compiled_engine.graphs.passes.lower_sdpa import PAGED_ATTENTION_TARGETS, SDPA_TARGETS, LowerSdpa
from compiled_engine.graphs.passes.noop_elimination import NoopElimination
from compiled_engine.graphs.passes.onednn_linear import PackLinearWeights
from compiled_engine.graphs.passes.widened_linear import WidenLinears
from compiled_engine.graphs.step_inputs import STEP_METADATA_TARGETS, StepInputs
from compiled_engine.kernels import PAGED_ATTENTION_VERSION

VOCAB = 96
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 16
WINDOW = 4  # shorter than the test sequences, so a dropped sliding window changes the logits
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=NUM_KV_HEADS,
    head_dim=HEAD_DIM,
    max_position_embeddings=128,
    attn_implementation="eager",
)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),  # q/k RMSNorm inside attention
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": WINDOW}),
    # Logit soft-capping (no SDPA support in HF) and interleaved sliding-window layers.
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        {
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 0.5,
            "query_pre_attn_scalar": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}
TOLERANCE = 1e-5


def make_model(arch: str, seed: int = 0) -> torch.nn.Module:
    config_class, model_class, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    return model_class(config_class(**_COMMON, **extra)).eval()


class PagedBatch:
    """Lays sequences out in a paged KV cache and builds StepInputs for chunks of them.

    Sequence s owns blocks [s * blocks_per_seq, (s + 1) * blocks_per_seq), in reverse order
    inside that run, so a wrong block-table lookup reads another position's keys.
    """

    def __init__(self, block_size: int = 4, blocks_per_seq: int = 6, max_seqs: int = 4) -> None:
        self.block_size = block_size
        self.blocks_per_seq = blocks_per_seq
        self.num_blocks = blocks_per_seq * max_seqs

    def kv_caches(self, num_layers: int, num_kv_heads: int, head_dim: int) -> list[torch.Tensor]:
        shape = (2, self.num_blocks, self.block_size, num_kv_heads, head_dim)
        return [torch.zeros(shape) for _ in range(num_layers)]

    def blocks(self, seq: int) -> torch.Tensor:
        start = seq * self.blocks_per_seq
        return torch.arange(start + self.blocks_per_seq - 1, start - 1, -1, dtype=torch.int32)

    def step(
        self, chunks: list[tuple[int, torch.Tensor, int]], logits_rows: list[int] | None = None
    ) -> StepInputs:
        """chunks: (sequence id, its token ids this step, position of the first one)."""
        positions = [torch.arange(start, start + len(tokens)) for _, tokens, start in chunks]
        tables = torch.stack([self.blocks(seq) for seq, _, _ in chunks])
        slots = [
            tables[i][pos // self.block_size].long() * self.block_size + pos % self.block_size
            for i, pos in enumerate(positions)
        ]
        lengths = torch.tensor([len(tokens) for _, tokens, _ in chunks])
        num_tokens = int(lengths.sum())
        rows = torch.arange(num_tokens) if logits_rows is None else torch.tensor(logits_rows)
        return StepInputs(
            input_ids=torch.cat([tokens for _, tokens, _ in chunks])[None],
            positions=torch.cat(positions)[None],
            slot_mapping=torch.cat(slots),
            block_tables=tables,
            seq_lens=torch.tensor([start + len(t) for _, t, start in chunks], dtype=torch.int32),
            query_start_loc=torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int32),
            logits_indices=rows.long(),
        )


def eager_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens[None]).logits[0]


def count_nodes(gm: torch.fx.GraphModule, targets: tuple) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def count_softmax(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if "softmax" in str(n.target))


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_captured_logits_match_hf_eager(arch: str) -> None:
    model = make_model(arch)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, VOCAB, (n,), generator=generator) for n in (11, 9, 13)]
    # Teacher forcing: the eager full forward over each whole sequence is the reference for
    # every row, whichever step (prefill chunk or decode) computes it in the engine.
    references = [eager_logits(model, seq) for seq in sequences]

    paged = PagedBatch()
    captured = capture_model(model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))

    def check(chunks: list[tuple[int, int, int]]) -> None:
        """chunks: (sequence id, first position, end position) computed in one step."""
        inputs = paged.step([(s, sequences[s][a:b], a) for s, a, b in chunks])
        expected = torch.cat([references[s][a:b] for s, a, b in chunks])
        got = captured(inputs)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0, msg=lambda m: f"{chunks}: {m}")

    check([(0, 0, 7)])  # full prefill of one sequence
    check([(1, 0, 5), (2, 0, 8)])  # two prefills packed in one flat row
    for position in range(7, 11):  # sequence 0 alone, one token at a time
        check([(0, position, position + 1)])
    check([(1, 5, 6), (2, 8, 9)])  # two decodes together
    check([(1, 6, 9), (2, 9, 10)])  # a prefill chunk and a decode in the same step

    # Dynamo specialises sizes 1: the general graph, single-sequence prefill, one-token decode.
    assert len(captured.graphs) == 3
    assert len(captured.pass_log) == len(captured.graphs)
    for gm in captured.graphs:
        assert count_nodes(gm, PAGED_ATTENTION_TARGETS) == NUM_LAYERS
        assert count_nodes(gm, SDPA_TARGETS) == 0
        assert count_nodes(gm, STEP_METADATA_TARGETS) == 0
        assert count_softmax(gm) == 0


def test_attention_arguments_reach_the_op() -> None:
    model = make_model("gemma2")
    paged = PagedBatch()
    captured = capture_model(model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    captured(paged.step([(0, torch.arange(6), 0)]))
    calls = [n for n in captured.graphs[0].graph.nodes if n.target in PAGED_ATTENTION_TARGETS]
    # (scale, sliding_window, softcap) are the op's last three arguments, Python constants.
    assert [tuple(n.args[-3:]) for n in calls] == [(24**-0.5, WINDOW, 0.5), (24**-0.5, -1, 0.5)]
    # Each layer writes its own cache.
    assert [n.args[3].name for n in calls] == ["l_kv_caches_0_", "l_kv_caches_1_"]


def test_logits_only_for_requested_rows() -> None:
    model = make_model("qwen3")
    tokens = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(2))
    reference = eager_logits(model, tokens)
    paged = PagedBatch()
    captured = capture_model(model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))

    got = captured(paged.step([(0, tokens[:4], 0), (1, tokens, 0)], logits_rows=[3, 13]))
    assert got.shape == (2, VOCAB)
    torch.testing.assert_close(got[0], reference[3], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(got[1], reference[9], atol=TOLERANCE, rtol=0)


def test_runs_under_inference_mode_and_writes_the_cache() -> None:
    model = make_model("llama")
    paged = PagedBatch()
    kv_caches = paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM)
    captured = capture_model(model, kv_caches)
    with torch.inference_mode():
        captured(paged.step([(0, torch.arange(5), 0)]))
    # Positions 0..4 of sequence 0 live in its first two blocks (reversed run: 5, then 4).
    assert kv_caches[0][:, 5].abs().sum() > 0
    assert kv_caches[0][:, 4, 0].abs().sum() > 0 and kv_caches[0][:, 4, 1:].abs().sum() == 0
    assert kv_caches[1][:, :4].abs().sum() == 0


def test_unflattened_batch_is_rejected_with_our_error() -> None:
    model = make_model("llama")
    paged = PagedBatch()
    captured = capture_model(model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    inputs = paged.step([(0, torch.arange(4), 0)])
    two_rows = inputs._replace(
        input_ids=inputs.input_ids.repeat(2, 1), positions=inputs.positions.repeat(2, 1)
    )
    with pytest.raises(UnsupportedModelError, match="LlamaAttention: .*batch size 1"):
        captured(two_rows)


def test_model_called_without_step_metadata_names_the_problem() -> None:
    model = make_model("llama")
    paged = PagedBatch()
    capture_model(model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
    with pytest.raises(UnsupportedModelError, match="needs the step metadata"):
        model(input_ids=torch.arange(3)[None])


@pytest.mark.parametrize(
    ("kv_caches", "message"),
    [
        ([], "non-empty list"),
        ([torch.zeros(4, 4, 2, 16)], r"kv_caches\[0\] must be \[2, num_blocks"),
        ((torch.zeros(2, 4, 4, 2, 16),), "non-empty list"),
    ],
)
def test_bad_kv_caches_are_rejected(kv_caches, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        capture_model(make_model("llama"), kv_caches)


class _InPlaceScale(torch.nn.Module):
    def forward(self, x):
        unused = x * 3  # dead: must go
        x.mul_(2)  # result unused, effect needed: must stay
        del unused
        return x + 1


def test_dce_keeps_in_place_calls_and_drops_dead_nodes() -> None:
    gm = torch.fx.symbolic_trace(_InPlaceScale())
    result = DeadCodeElimination()(gm)
    gm.recompile()
    assert result.nodes_rewritten == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["mul_"]
    assert torch.equal(gm(torch.ones(2)), torch.full((2,), 3.0))


def test_pass_manager_version_covers_passes_and_op() -> None:
    manager = default_pass_manager("AnyModel", 2)
    # Every pass in pipeline order (per-bucket ones marked), each with its source hash, then the op.
    capture = [LowerSdpa, NoopElimination, DeadCodeElimination, CheckLowering]
    per_bucket = [
        GemvLowering,
        CpuGemvLinears,
        PackLinearWeights,
        WidenLinears,
        CpuGemvQuantized,
        CpuGemmQuantized,
        InlineAttention,
    ]
    assert manager.version() == ";".join(
        [f"{p.name}={p.version}" for p in capture]
        + [f"bucket:{p.name}={p.version}" for p in per_bucket]
        + [PAGED_ATTENTION_VERSION]
    )
    assert manager.uuid() == default_pass_manager("OtherModel", 4).uuid()  # model-independent
    bumped = LowerSdpa()
    bumped.version = "2"
    assert (
        PassManager([bumped, DeadCodeElimination()]).uuid()
        != PassManager([LowerSdpa(), DeadCodeElimination()]).uuid()
    )
    with pytest.raises(ValueError, match="unique"):
        PassManager([DeadCodeElimination(), DeadCodeElimination()])


def test_each_captured_model_has_its_own_dynamo_cache(monkeypatch) -> None:
    # Dynamo's cache and recompile count live on the code object. With a shared step function,
    # engines created one after another in a process pile their graphs into one cache and hit
    # the recompile limit; a limit of 2 makes the third engine fail unless each has its own.
    monkeypatch.setattr(capture, "_RECOMPILE_LIMIT", 2)
    paged = PagedBatch()
    model = make_model("llama")
    for _ in range(4):
        captured = capture_model(model, paged.kv_caches(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM))
        captured(paged.step([(0, torch.arange(5), 0), (1, torch.arange(3), 0)]))
        assert len(captured.graphs) == 1
