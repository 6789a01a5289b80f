"""Pipeline parallelism: the layer split, bad input, and 2-stage engines (alone and with 2 TP ranks
per stage) on gloo, against the single-process engine.

The engine tests start real worker processes (spawn), as `LLM(pipeline_parallel_size=2)` does for
a user; the test process is rank 0 (stage 0).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from compiled_engine import LLM, SamplingParams
from compiled_engine.distributed.pipeline_stages import slice_for_stage, split_layers, stage_of_rank
from compiled_engine.distributed.workers import TensorParallelWorkerError
from compiled_engine.graphs.compiled_step import CompiledStep
from compiled_engine.graphs.pipeline_step_graph import (
    STEPS_IN_FLIGHT_ENV,
    PipelineStepGraph,
    split_sequences,
    steps_in_flight,
)
from compiled_engine.model_loader.loader import load_model
from tests.model_factory import make_tiny_model

WORKER_NAME = "compiled-engine-tp-rank"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = dict(
    device="cpu",
    max_num_seqs=4,
    max_model_len=64,
    num_kv_blocks=48,
    compile_buckets=(1, 2, 4),
    enable_prefix_caching=False,
)


def _workers() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith(WORKER_NAME)]


def _wait_no_workers(timeout_s: float = 20.0) -> list[multiprocessing.Process]:
    deadline = time.monotonic() + timeout_s
    while _workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    return _workers()


def _assert_nothing_left() -> None:
    assert _wait_no_workers() == []
    assert not dist.is_initialized()


def _prompts(vocab: int, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]}
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def four_layer_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny models with 4 decoder layers: 2 per stage, so a stage runs more than one layer."""
    root = tmp_path_factory.mktemp("pp-models")
    return {arch: str(make_tiny_model(root / arch, arch=arch, num_layers=4)) for arch in ("llama", "qwen3")}


def _single_process_tokens(model_dir: str, prompts, params=GREEDY, **engine) -> list[tuple[int, ...]]:
    llm = LLM(model_dir, **{**ENGINE, **engine})
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()


# -- the split ------------------------------------------------------------------------------------


def test_layers_split_into_contiguous_stages_earlier_ones_taking_the_remainder():
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_layers(3, 1) == [(0, 3)]
    # TP=2 x PP=2: ranks 0-1 are stage 0, ranks 2-3 stage 1; each talks to its peer TP rank.
    stage = stage_of_rank(3, num_layers=4, num_stages=2, tp_size=2)
    assert (stage.index, stage.tp_rank, stage.first_layer, stage.end_layer) == (1, 1, 2, 4)
    assert (stage.previous_rank, stage.first_stage_rank, stage.is_last) == (1, 1, True)


def test_a_step_splits_into_micro_batches_of_whole_sequences_about_equal_in_tokens():
    # query_start_loc of 4 sequences of 10, 1, 1 and 8 tokens.
    assert split_sequences([0, 10, 11, 12, 20], 2) == [(0, 1), (1, 4)]
    assert split_sequences([0, 1, 2, 3, 4], 2) == [(0, 2), (2, 4)]
    assert split_sequences([0, 5], 2) == [(0, 1)]  # one sequence: one micro-batch
    assert split_sequences([0, 1, 2, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    assert split_sequences([0, 30, 31, 32], 3) == [(0, 1), (1, 2), (2, 3)]  # none empty


def test_a_bad_steps_in_flight_override_is_refused_by_name(llama_dir, monkeypatch):
    assert steps_in_flight(2) == 2  # default: one step in flight per stage
    monkeypatch.setenv(STEPS_IN_FLIGHT_ENV, "1")
    assert steps_in_flight(2) == 1
    for bad in ("0", "3", "two"):
        monkeypatch.setenv(STEPS_IN_FLIGHT_ENV, bad)
        with pytest.raises(ValueError, match=f"{STEPS_IN_FLIGHT_ENV} must be an int from 1 to the 2"):
            steps_in_flight(2)
    with pytest.raises(ValueError, match=f"{STEPS_IN_FLIGHT_ENV} must be an int from 1 to the 2"):
        LLM(llama_dir, pipeline_parallel_size=2, enforce_eager=True, **ENGINE)
    assert not _workers()  # refused before any worker started


def test_bad_pipeline_sizes_are_refused_by_name(llama_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive int, got 0"):
        LLM(llama_dir, pipeline_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive int, got -1"):
        split_layers(4, -1)
    # The tiny model has 2 decoder layers: 3 stages cannot each own one. Refused before any
    # worker starts.
    with pytest.raises(
        ValueError, match="pipeline_parallel_size=3 is more than the model's 2 decoder layers"
    ):
        LLM(llama_dir, pipeline_parallel_size=3, enforce_eager=True, **ENGINE)
    assert not _workers()
    with pytest.raises(
        ValueError, match="async_scheduling=True is not supported with pipeline_parallel_size"
    ):
        LLM(llama_dir, pipeline_parallel_size=2, async_scheduling=True, **ENGINE)
    with pytest.raises(ValueError, match="compile_policy='background' is not supported with pipeline"):
        LLM(llama_dir, pipeline_parallel_size=2, compile_policy="background", **ENGINE)
    assert not dist.is_initialized()


# -- per-stage loading ---------------------------------------------------------------------------


def _stage_needs(name: str, stage_index: int, tied: bool) -> bool:
    """The checkpoint tensors stage `stage_index` of 2 (4 layers: 0-1, 2-3) must read."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer is not None:
        return int(layer.group(1)) // 2 == stage_index
    if name == "model.embed_tokens.weight":  # also the LM head, when tied
        return stage_index == 0 or tied
    assert name in ("model.norm.weight", "lm_head.weight"), name
    return stage_index == 1


@pytest.mark.parametrize("tied", [False, True], ids=["separate-head", "tied-head"])
def test_each_stage_reads_only_its_own_tensors_from_the_shards(tmp_path, tied):
    model_dir = make_tiny_model(tmp_path, num_layers=4, tie_word_embeddings=tied, max_shard_size="40KB")
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    in_checkpoint = set(index["weight_map"])
    assert len(set(index["weight_map"].values())) > 2  # several shards
    whole = load_model(model_dir)
    assert whole.checkpoint_tensors_read == in_checkpoint
    whole_params = dict(whole.model.named_parameters(remove_duplicate=False))
    read_by_stages = []
    for stage_index in (0, 1):
        stage = stage_of_rank(stage_index, num_layers=4, num_stages=2, tp_size=1)
        loaded = load_model(model_dir, keep=stage.holds_tensor)
        expected = {name for name in in_checkpoint if _stage_needs(name, stage_index, tied)}
        assert loaded.checkpoint_tensors_read == expected
        read_by_stages.append(loaded.checkpoint_tensors_read)
        sliced = slice_for_stage(loaded, stage)
        # Every tensor the stage keeps is loaded (slice_for_stage checks none is left on meta)
        # and equals the whole model's, its layers renumbered from 0.
        for name, param in sliced.model.named_parameters():
            layer = re.match(r"model\.layers\.(\d+)\.(.*)", name)
            source = (
                f"model.layers.{int(layer.group(1)) + stage.first_layer}.{layer.group(2)}" if layer else name
            )
            assert torch.equal(param, whole_params[source]), name
    # Between them the stages read the checkpoint once (a tied table: once per end stage).
    assert read_by_stages[0] | read_by_stages[1] == in_checkpoint
    assert (read_by_stages[0] & read_by_stages[1]) == ({"model.embed_tokens.weight"} if tied else set())


# -- engines --------------------------------------------------------------------------------------


def test_two_stages_eager_match_one_process(llama_dir):
    # The default run's one engine test: 2 layers, one per stage, eager (no Inductor compile).
    # Six concurrent requests of different lengths (and max_tokens): the engine core keeps two
    # steps in flight, each with its own requests, as they come and go.
    prompts = _prompts(384, 6, seed=3)
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    # A penalised request: its sampling, run when its logits arrive, reads its token counts.
    params.append(SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, repetition_penalty=1.3))
    *expected, keep_reference = _single_process_tokens(
        llama_dir, [*prompts, prompts[0]], [*params, GREEDY], enforce_eager=True
    )
    llm = LLM(llama_dir, pipeline_parallel_size=2, enforce_eager=True, **ENGINE)
    try:
        assert len(_workers()) == 1
        engine = llm.engine
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert outputs == expected
        assert engine.core.max_steps_in_flight == 2  # stage 0 ran step N+1 before step N's logits came
        assert engine.num_free_kv_blocks() == engine.num_kv_blocks
        # Stage 0 holds the first layer's KV cache only.
        assert len(engine.model_runner.kv_caches) == 1

        # Aborting a request while its step is in flight, with the other step in flight too: its
        # blocks come back once that step is collected, and the other requests run on unharmed.
        for request_id, prompt in zip(("keep", "abort"), prompts[:2], strict=True):
            processed, request_params = engine.validate([prompt], GREEDY)[0]
            engine.add_request(request_id, processed, request_params)
        engine.step()
        assert engine.core.scheduler.num_in_flight_steps == 1  # "keep"'s first step is collected...
        engine.abort_request(["abort"])  # ...and "abort"'s is still in flight
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        assert [(o.request_id, o.outputs[0].token_ids) for o in finished] == [("keep", keep_reference)]
        assert engine.num_free_kv_blocks() == engine.num_kv_blocks
    finally:
        llm.close()
    _assert_nothing_left()


@pytest.mark.slow  # two stages compiled by Inductor, per architecture (~1 min each on 2 cores)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_stages_compiled_match_one_process(four_layer_dirs, arch):
    model_dir = four_layer_dirs[arch]
    prompts = _prompts(384, 10, seed=3)
    # A penalised request and one with prompt logprobs: the last stage's logits reach rank 0's
    # sampler, and prompt logprobs take the dynamic graph.
    extra = [
        (prompts[0], SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3)),
        (prompts[1], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1)),
    ]
    single = LLM(model_dir, **ENGINE)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    expected_extra = [single.generate([p], s, use_tqdm=False)[0] for p, s in extra]
    single.close()

    llm = LLM(model_dir, pipeline_parallel_size=2, **ENGINE)
    try:
        step_graph = llm.engine.model_runner.step_graph
        assert isinstance(step_graph, PipelineStepGraph) and isinstance(step_graph.inner, CompiledStep)
        assert len(llm.engine.model_runner.kv_caches) == 2  # layers 0-1 of 4
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert outputs == expected
        for (prompt, params), reference in zip(extra, expected_extra, strict=True):
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference.outputs[0].token_ids
            if params.prompt_logprobs:
                ours = [next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]]
                theirs = [next(iter(e.values())).logprob for e in reference.prompt_logprobs[1:]]
                assert ours == pytest.approx(theirs, abs=1e-5)
        # No step plans in a stage: recording one runs the step, and its hand-offs, again.
        assert step_graph.inner.decode_graphs.graphs is None
    finally:
        llm.close()
    _assert_nothing_left()


@pytest.mark.slow  # four processes (2 TP ranks x 2 stages) on 2 cores
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_two_tensor_parallel_ranks_per_stage_match_one_process(four_layer_dirs, enforce_eager):
    model_dir = four_layer_dirs["llama"]
    prompts = _prompts(384, 6, seed=4)
    expected = _single_process_tokens(model_dir, prompts, enforce_eager=enforce_eager)
    llm = LLM(
        model_dir, tensor_parallel_size=2, pipeline_parallel_size=2, enforce_eager=enforce_eager, **ENGINE
    )
    try:
        assert len(_workers()) == 3
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert outputs == expected
    finally:
        llm.close()
    _assert_nothing_left()


@pytest.mark.slow  # starts a 2-stage engine only to kill it
def test_a_killed_stage_stops_the_engine_with_a_clear_error_and_every_process_ends(four_layer_dirs):
    llm = LLM(four_layer_dirs["llama"], pipeline_parallel_size=2, enforce_eager=True, **ENGINE)
    try:
        prompts = _prompts(384, 3, seed=5)
        assert len(llm.generate(prompts, GREEDY, use_tqdm=False)) == 3
        (worker,) = _workers()
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(
            TensorParallelWorkerError, match=r"rank 1 \(pid \d+\) exited with code -9 \(SIGKILL\)"
        ):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 10
        with pytest.raises(TensorParallelWorkerError, match="cannot run steps any more"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    finally:
        llm.close()
    _assert_nothing_left()


# -- on Ray, across two (simulated) nodes ----------------------------------------------------------


@pytest.fixture
def ray_cluster():
    """Starts Ray's test cluster of two simulated nodes (raylets) on this machine, with the CPUs
    each test asks for: `start(head_cpus, other_cpus)` -> (cluster, head node id, other node id)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    clusters = []

    def start(head_cpus: int, other_cpus: int):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus})
        clusters.append(cluster)
        other = cluster.add_node(num_cpus=other_cpus)
        ray.init(address=cluster.address, log_to_driver=False)
        return cluster, ray.get_runtime_context().get_node_id(), other.node_id

    try:
        yield start
    finally:
        ray.shutdown()
        for cluster in clusters:
            cluster.shutdown()


def _placement_groups_left() -> list[str]:
    from ray.util import placement_group_table

    return [pg for pg, row in placement_group_table().items() if row["state"] != "REMOVED"]


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def _assert_ray_workers_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while (_alive(pids) or _placement_groups_left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive(pids) == [], "a worker actor's process outlived the engine"
    assert _placement_groups_left() == [], "a placement group outlived the engine"
    assert not dist.is_initialized()


@pytest.mark.slow  # a Ray test cluster of two simulated nodes, and a worker actor
def test_two_stages_on_ray_place_stage_1_on_the_other_node_and_match_one_process(llama_dir, ray_cluster):
    from compiled_engine.distributed.ray_placement import RayPlacementError

    prompts = _prompts(384, 4, seed=6)
    expected = _single_process_tokens(llama_dir, prompts, enforce_eager=True)
    # The head (rank 0's node: this test's process) has no CPU for a worker: stage 1 can only go
    # to the other node.
    _, head, other = ray_cluster(0, 2)
    llm = LLM(
        llama_dir, pipeline_parallel_size=2, distributed_executor_backend="ray", enforce_eager=True, **ENGINE
    )
    try:
        workers = llm.engine.tensor_parallel.workers
        assert workers.node_ids == [other] and head != other
        # The rendezvous is the node's address, not the loopback one.
        assert not llm.engine.tensor_parallel.group.address.host.startswith("127.")
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert outputs == expected
        pids = list(workers.pids)
        # Stage 1's actor dies: the next step names it, and close() still leaves nothing behind.
        ray = pytest.importorskip("ray")
        ray.kill(workers.actors[0])
        with pytest.raises(
            TensorParallelWorkerError, match=r"rank 1 \(Ray actor, pid \d+, node \w+\) failed"
        ):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.close()
    _assert_ray_workers_gone(pids)
    # TP=2 x PP=2 here: stage 0's second rank must share rank 0's node, which has no CPU. Refused
    # by name before any actor starts.
    with pytest.raises(
        RayPlacementError,
        match=r"pipeline stage 0 \(worker rank 1\).* cannot be placed: rank 0's node \w+ has "
        r"\{'CPU': 0\} in all, and needs \{'CPU': 1.0\}",
    ):
        LLM(
            llama_dir,
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            distributed_executor_backend="ray",
            enforce_eager=True,
            **ENGINE,
        )
    assert _placement_groups_left() == [] and not dist.is_initialized()


@pytest.mark.slow  # a Ray test cluster of two simulated nodes, three worker actors, then a refusal
def test_two_tensor_parallel_ranks_per_stage_on_ray_share_a_node_per_stage(
    four_layer_dirs, ray_cluster, monkeypatch
):
    from compiled_engine.distributed import ray_workers
    from compiled_engine.distributed.ray_placement import RayPlacementError

    model_dir = four_layer_dirs["llama"]
    prompts = _prompts(384, 4, seed=7)
    expected = _single_process_tokens(model_dir, prompts, enforce_eager=True)
    # One CPU on rank 0's node (stage 0's rank 1), two on the other (stage 1's ranks 2 and 3).
    _, head, other = ray_cluster(1, 2)
    llm = LLM(
        model_dir,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        enforce_eager=True,
        **ENGINE,
    )
    try:
        workers = llm.engine.tensor_parallel.workers
        assert workers.node_ids == [head, other, other]  # ranks 1, 2, 3
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        pids = list(workers.pids)
        # A second engine while this one holds every CPU: its stage 1 cannot be placed in time,
        # and the error names the stage and what it asked for.
        monkeypatch.setattr(ray_workers, "PLACEMENT_TIMEOUT_S", 3.0)
        with pytest.raises(
            RayPlacementError,
            match=r"pipeline stage 1 \(worker rank 1\): 1 bundle\(s\) of \{'CPU': 1.0\} on one node could "
            r"not be placed within 3 s",
        ):
            LLM(
                model_dir,
                pipeline_parallel_size=2,
                distributed_executor_backend="ray",
                enforce_eager=True,
                **ENGINE,
            )
        assert len(_placement_groups_left()) == 2  # the running engine's two stages' only
    finally:
        llm.close()
    assert outputs == expected
    _assert_ray_workers_gone(pids)
