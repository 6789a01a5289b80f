"""Decode steps replayed from captured bucket graphs (graphs/decode_graphs.py), on the CPU runtime.

The CPU runtime's "capture" is the compiled callable itself, so these tests check the control
flow the CUDA path shares: which steps replay, static arguments over in-place buffer updates,
capture order, and a KV-cache swap.
"""

from __future__ import annotations

import pytest
import torch

from compiled_engine.graphs.compiled_step import CompiledStep
from compiled_engine.graphs.device import CpuGraph, CpuRuntime, GraphPool, StepFn
from compiled_engine.model_loader.loader import load_model
from compiled_engine.worker.input_buffers import InputBuffers
from tests.test_compiled_step import BLOCK_SIZE, _step, random_kv_caches

BUCKETS = (1, 2, 4, 8)
MAX_SEQS = 4


class RecordingRuntime(CpuRuntime):
    """The CPU runtime, recording captures and replays; it captures at capture_graphs() only, as
    CUDA does (tests/test_cpu_step_plan.py covers the CPU's captures on demand)."""

    captures_on_demand = False

    def __init__(self) -> None:
        super().__init__()
        self.replays = 0

    def capture(self, fn: StepFn, pool: GraphPool | None = None) -> CpuGraph:
        runtime = self

        class Counted(CpuGraph):
            def replay(self) -> torch.Tensor:
                runtime.replays += 1
                return super().replay()

        graph = Counted(fn)
        graph.replay()  # the warm-up a capture does
        runtime.replays -= 1
        return graph


@pytest.fixture(scope="module")
def steps(llama_dir):
    loaded = load_model(llama_dir, dtype="float32")
    caches = random_kv_caches(loaded.model_config)
    runtime = RecordingRuntime()
    buffers = InputBuffers(64, MAX_SEQS, 256, BLOCK_SIZE, torch.device("cpu"))
    graphed = CompiledStep(loaded.model, caches, buffers.whole(), BUCKETS, runtime=runtime)
    graphed.capture_graphs()
    graphs = graphed.decode_graphs.graphs
    plain_buffers = InputBuffers(64, MAX_SEQS, 256, BLOCK_SIZE, torch.device("cpu"))
    plain = CompiledStep(loaded.model, caches, plain_buffers.whole(), BUCKETS)
    return graphed, buffers, plain, plain_buffers, caches, runtime, graphs


def test_graph_buckets_are_captured_largest_first(steps):
    _, _, _, _, _, _, graphs = steps
    # Buckets above max_num_seqs cannot hold a decode batch: not captured.
    assert list(graphs.capture_seconds) == [4, 2, 1]
    assert sorted(graphs.captured_buckets) == [1, 2, 4]


@pytest.mark.parametrize(
    "spec, replayed",
    [
        ([(1, 20, True)], True),
        ([(1, 5, True), (1, 40, True), (1, 17, True)], True),
        ([(1, 9, True)] * 4, True),
        ([(3, 0, True), (1, 30, True)], False),  # mixed prefill: the uncaptured bucket graph
        ([(2, 0, True)], False),
    ],
)
def test_replayed_decode_matches_the_uncaptured_step(steps, spec, replayed):
    graphed, buffers, plain, plain_buffers, caches, runtime, _ = steps
    before = [c.clone() for c in caches]
    with torch.inference_mode():
        expected = plain(plain_buffers.prepare(_step(spec)).inputs).clone()
        plain_caches = [c.clone() for c in caches]
        for cache, saved in zip(caches, before, strict=True):
            cache.copy_(saved)
        replays = runtime.replays
        logits = graphed(buffers.prepare(_step(spec)).inputs)
    assert (runtime.replays - replays == 1) is replayed
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    for ours, theirs in zip(caches, plain_caches, strict=True):
        torch.testing.assert_close(ours[:, :-1], theirs[:, :-1], rtol=0, atol=1e-5)


def test_new_kv_caches_drop_the_graphs_until_recaptured(steps):
    graphed, buffers, _, _, caches, runtime, _ = steps
    bigger = [torch.zeros(c.shape[0], c.shape[1] + 8, *c.shape[2:]) for c in caches]
    graphed.set_kv_caches(bigger)
    spec = [(1, 3, True)]
    with torch.inference_mode():
        replays = runtime.replays
        uncaptured = graphed(buffers.prepare(_step(spec)).inputs).clone()
        assert runtime.replays == replays
        graphed.capture_graphs()
        replayed = graphed(buffers.prepare(_step(spec)).inputs)
        assert runtime.replays == replays + 1
    torch.testing.assert_close(replayed, uncaptured, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="does not match"):
        graphed.set_kv_caches([torch.zeros(2, 4, BLOCK_SIZE, 1, 1) for _ in caches])
    graphed.set_kv_caches(caches)


def test_dummy_step_of_the_whole_budget_runs(llama_dir):
    # What the CUDA start-up runs to measure the peak memory of the largest step.
    from compiled_engine import LLM

    llm = LLM(llama_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40,
              compile_buckets=[1, 2, 4], num_kv_blocks=8)  # fmt: skip
    runner = llm.engine.model_runner
    runner.run_dummy_step(64)  # two sequences of 40 and 24 tokens, both in block 0
    assert runner.capture_graphs() == 0  # CPU: graphs hold no device memory
    runner.release_graphs()
    assert llm.engine.num_free_kv_blocks() == 8
