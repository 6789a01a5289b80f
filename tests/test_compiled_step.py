"""Inductor-compiled bucket graphs give the eager captured graph's logits and KV writes."""

from __future__ import annotations

import pytest
import torch

from compiled_engine.graphs.bucket_compiler import BucketVariant
from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.compiled_step import CompiledStep
from compiled_engine.graphs.passes.lower_sdpa import PAGED_ATTENTION_TARGETS
from compiled_engine.model_loader.loader import load_model
from compiled_engine.records.scheduler_output import ScheduledRequest, SchedulerOutput
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.worker.input_buffers import InputBuffers

BUCKETS = (1, 2, 4, 8)
BLOCK_SIZE = 16
NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0.0)


def _step(spec: list[tuple[int, int, bool]]) -> SchedulerOutput:
    """spec: (query tokens, start position, samples?) per request; request i owns blocks 8i...."""
    requests = tuple(
        ScheduledRequest(
            request_id=f"r{i}",
            token_ids=tuple((11 * i + j) % 300 for j in range(n)),
            start_position=start,
            block_ids=tuple(range(8 * i, 8 * i + -(-(start + n) // BLOCK_SIZE))),
            sample=sample,
            sampling_params=GREEDY,
            num_output_tokens=0,
        )
        for i, (n, start, sample) in enumerate(spec)
    )
    return SchedulerOutput(requests, sum(n for n, _, _ in spec), (), ())


def random_kv_caches(model_config) -> list[torch.Tensor]:
    """Random (not zero) caches, seeded: a padded row that wrote or read a real block would show."""
    torch.manual_seed(0)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model_config.num_kv_heads, model_config.head_dim)
    return [torch.randn(shape) for _ in range(model_config.num_layers)]


@pytest.fixture(scope="module")
def setup(llama_dir):
    loaded = load_model(llama_dir, dtype="float32")
    caches = random_kv_caches(loaded.model_config)
    buffers = InputBuffers(64, 6, 256, BLOCK_SIZE, torch.device("cpu"))
    compiled = CompiledStep(loaded.model, caches, buffers.whole(), BUCKETS)
    eager = capture_model(loaded.model, caches)
    return compiled, eager, buffers, caches


# (spec, graph expected to serve it): decodes, mixed prefill + decode, a chunk that samples
# nothing, a step above the largest bucket (dynamic graph), one sequence with a 1-block table.
STEPS = [
    ([(1, 20, True)], 1),
    ([(1, 5, True), (1, 40, True)], 2),
    ([(3, 0, True), (2, 30, False)], 8),
    ([(1, 3, True)] * 4, 4),
    ([(1, 9, True)] * 6, 8),
    ([(10, 0, True), (3, 17, True)], None),
    ([(30, 0, False)], None),
    ([(2, 0, True)], 2),
]


@pytest.mark.parametrize("spec, bucket", STEPS)
def test_compiled_matches_eager(setup, spec, bucket):
    compiled, eager, buffers, caches = setup
    before = [c.clone() for c in caches]
    with torch.inference_mode():
        expected = eager(buffers.prepare(_step(spec)).inputs).clone()
        eager_caches = [c.clone() for c in caches]
        for cache, saved in zip(caches, before, strict=True):
            cache.copy_(saved)
        logits = compiled(buffers.prepare(_step(spec)).inputs)

    assert bucket in compiled.compiled_buckets
    num_sampled = sum(sample for _, _, sample in spec)
    assert logits.shape == (num_sampled, expected.shape[1])
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    for ours, theirs, old in zip(caches, eager_caches, before, strict=True):
        # The scratch block holds whatever padding each run wrote: not compared.
        torch.testing.assert_close(ours[:, :-1], theirs[:, :-1], rtol=0, atol=1e-5)
        # Padded rows (slot -1) write only the scratch block (the last): every other slot the
        # eager step left alone is bit-identical.
        untouched = (theirs == old).all(dim=-1).all(dim=-1)
        untouched[:, -1] = False
        assert torch.equal(ours[untouched], old[untouched])


def test_buckets_compile_once_and_only_when_used(setup):
    compiled, _, buffers, _ = setup
    seconds = dict(compiled.compile_seconds)
    with torch.inference_mode():
        compiled(buffers.prepare(_step([(1, 20, True)])).inputs)
    assert compiled.compile_seconds == seconds  # served by the artifact compiled before
    assert set(compiled.compiled_buckets) <= {*BUCKETS, None}
    with pytest.raises(ValueError, match="3 is not one of the buckets"):
        compiled.compile_buckets([3])


def test_buffers_without_padding_room_are_refused(llama_dir):
    loaded = load_model(llama_dir, dtype="float32")
    mc = loaded.model_config
    caches = [torch.zeros(2, 4, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim) for _ in range(mc.num_layers)]
    # max_model_len 32 at block size 16: only 2 block-table columns.
    narrow = InputBuffers(64, 6, 32, BLOCK_SIZE, torch.device("cpu"))
    with pytest.raises(
        ValueError, match="at least 2 sequence rows and 3 block-table columns, got block_tables 6x2"
    ):
        CompiledStep(loaded.model, caches, narrow.whole(), BUCKETS)


def test_decode_buckets_inline_the_attention_on_cpu(setup):
    compiled, _, _, _ = setup
    compiled.compile_buckets([1, 8, None])
    # Buckets that can be decode batches (<= max_num_seqs = 6) run the fused maths; the rest the op.
    assert compiled.builds[1].variant.inline_attention and not compiled.builds[8].variant.inline_attention
    assert not compiled.builds[None].variant.inline_attention
    graph, passes = compiled.bucket_graph(1)
    assert BucketVariant.from_report(passes).inline_attention
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    num_layers = len(compiled.kv_caches)
    assert targets.count(torch.ops.compiled_engine.kv_cache_write.default) == num_layers
    assert targets.count(torch.ops.compiled_engine.paged_attention_inline.default) == num_layers
    assert not any(t in PAGED_ATTENTION_TARGETS for t in targets)
    # The traced graph itself is untouched (the variant is a copy sharing its weights).
    traced = [n.target for n in compiled.traced.graph.graph.nodes if n.op == "call_function"]
    assert sum(t in PAGED_ATTENTION_TARGETS for t in traced) == num_layers


def test_bucket_compile_without_standalone_compiles_fake_mode_argument(llama_dir, monkeypatch):
    """torch 2.11's standalone_compile has no fake_mode=: the mode goes in by the tracing context."""
    from compiled_engine.graphs import standalone_compile as compat

    calls = []
    real = torch._inductor.standalone_compile

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(compat, "TAKES_FAKE_MODE", False)
    monkeypatch.setattr(torch._inductor, "standalone_compile", spy)
    loaded = load_model(llama_dir, dtype="float32")
    mc = loaded.model_config
    torch.manual_seed(0)
    caches = [
        torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim) for _ in range(mc.num_layers)
    ]
    buffers = InputBuffers(64, 6, 256, BLOCK_SIZE, torch.device("cpu"))
    compiled = CompiledStep(loaded.model, caches, buffers.whole(), (2,))
    eager = capture_model(loaded.model, caches)
    spec = [(1, 5, True), (1, 40, True)]
    before = [c.clone() for c in caches]
    with torch.inference_mode():
        expected = eager(buffers.prepare(_step(spec)).inputs).clone()
        for cache, saved in zip(caches, before, strict=True):
            cache.copy_(saved)
        logits = compiled(buffers.prepare(_step(spec)).inputs)
    assert 2 in compiled.compiled_buckets
    assert [c["dynamic_shapes"] for c in calls] == ["from_tracing_context"]
    assert "fake_mode" not in calls[0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
