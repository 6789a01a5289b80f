"""Tensor parallelism: the weight layout, sharded loading, the graph pass, and 2-rank engines on gloo.

The engine tests start real worker processes (spawn) that join a gloo process group on
127.0.0.1 with the test process as rank 0, exactly as `LLM(tensor_parallel_size=2)` does for
a user.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import random
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from compiled_engine import LLM, SamplingParams
from compiled_engine.distributed.layout import Shard, TensorParallelLayout
from compiled_engine.distributed.process_group import RendezvousAddress, TensorParallelGroup
from compiled_engine.distributed.workers import TensorParallelWorkerError
from compiled_engine.errors import LoweringError, UnsupportedModelError
from compiled_engine.graphs.capture import capture_model
from compiled_engine.graphs.compiled_step import CompiledStep
from compiled_engine.graphs.passes.tensor_parallel import ALL_GATHER, ALL_REDUCE, ShardForTensorParallel
from compiled_engine.model_loader.loader import load_model
from tests.model_factory import make_tiny_model

WORKER_NAME = "compiled-engine-tp-rank"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _meta_model(model_dir: str):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def _tp_workers() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith(WORKER_NAME)]


def _assert_nothing_left() -> None:
    """No worker process of ours is alive, and this process left its process group."""
    assert not _tp_workers()
    assert not dist.is_initialized()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); its state in /proc says it is gone.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


# -- layout -----------------------------------------------------------------------------------------


def test_layout_splits_heads_mlp_and_vocab_by_the_models_plan(llama_dir):
    # tiny Llama: 4 query heads, 2 KV heads, head_dim 16, hidden 64, MLP 128, vocab 384.
    layout = TensorParallelLayout.for_model(_meta_model(llama_dir), rank=1, world_size=2)
    layer = "model.layers.0"
    assert layout.shard(f"{layer}.self_attn.q_proj.weight", (64, 64)) == Shard(0, 32, 32)
    assert layout.shard(f"{layer}.self_attn.k_proj.weight", (32, 64)) == Shard(0, 16, 16)
    assert layout.shard(f"{layer}.self_attn.o_proj.weight", (64, 64)) == Shard(1, 32, 32)
    assert layout.shard(f"{layer}.mlp.gate_proj.weight", (128, 64)) == Shard(0, 64, 64)
    assert layout.shard(f"{layer}.mlp.down_proj.weight", (64, 128)) == Shard(1, 64, 64)
    assert layout.shard("model.embed_tokens.weight", (384, 64)) == Shard(0, 192, 192)
    assert layout.shard("lm_head.weight", (384, 64)) == Shard(0, 192, 192)
    assert layout.shard(f"{layer}.input_layernorm.weight", (64,)) is None
    assert layout.local_kv_heads == 1 and layout.vocab_range == (192, 192)
    communicating = dict(layout.communicating_modules)
    assert communicating["model.embed_tokens"] == "embedding_rowwise"
    assert communicating["lm_head"] == "colwise_gather_output"
    assert sum(style == "rowwise" for style in communicating.values()) == 4  # o_proj, down_proj x 2


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head_with_its_query_heads(llama_dir):
    model = _meta_model(llama_dir)
    # 4 ranks, 2 KV heads: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1; one query head each.
    for rank, kv_head in enumerate((0, 0, 1, 1)):
        layout = TensorParallelLayout.for_model(model, rank=rank, world_size=4)
        assert layout.shard("model.layers.1.self_attn.v_proj.weight", (32, 64)) == Shard(0, 16 * kv_head, 16)
        assert layout.shard("model.layers.1.self_attn.q_proj.weight", (64, 64)) == Shard(0, 16 * rank, 16)
        assert layout.local_kv_heads == 1


def test_unsplittable_models_are_refused_by_name(llama_dir, tmp_path):
    with pytest.raises(
        UnsupportedModelError, match="num_attention_heads=4, not divisible by tensor_parallel_size=3"
    ):
        TensorParallelLayout.for_model(_meta_model(llama_dir), rank=0, world_size=3)
    model = _meta_model(llama_dir)
    model._tp_plan = {}
    with pytest.raises(UnsupportedModelError, match="no tensor-parallel plan"):
        TensorParallelLayout.for_model(model, rank=0, world_size=2)
    model._tp_plan = {"model.layers.*.mlp.down_proj": "sequence_parallel"}
    with pytest.raises(UnsupportedModelError, match="sequence_parallel"):
        TensorParallelLayout.for_model(model, rank=0, world_size=2)


def test_a_vocabulary_that_does_not_split_evenly_stays_whole(tmp_path):
    model_dir = make_tiny_model(tmp_path, vocab_size=385, with_tokenizer=False)
    layout = TensorParallelLayout.for_model(_meta_model(str(model_dir)), rank=1, world_size=2)
    assert layout.shard("model.embed_tokens.weight", (385, 64)) is None
    assert layout.shard("lm_head.weight", (385, 64)) is None
    assert {style for _, style in layout.communicating_modules} == {"rowwise"}


# -- sharded loading --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_rank_loads_exactly_its_slices(model_dirs, arch):
    full = dict(load_model(model_dirs[arch]).model.named_parameters())
    for rank in (0, 1):
        loaded = load_model(model_dirs[arch], tensor_parallel=(rank, 2))
        layout = loaded.tensor_parallel
        assert layout is not None and (layout.rank, layout.world_size) == (rank, 2)
        for name, param in loaded.model.named_parameters():
            shard = layout.shard(name, tuple(full[name].shape))
            expected = full[name] if shard is None else full[name][shard.index(full[name].dim())]
            if layout.zero_on_this_rank(name):
                expected = torch.zeros_like(expected)
            assert torch.equal(param, expected), name
    # Qwen2's q/k/v have biases: column-parallel, sliced with their rows.
    if arch == "qwen2":
        q_bias = loaded.model.get_parameter("model.layers.0.self_attn.q_proj.bias")
        assert q_bias.shape == (full["model.layers.0.self_attn.q_proj.bias"].shape[0] // 2,)


# -- the graph pass, in one process (a one-rank group: the collectives are identities) ------------


@pytest.fixture
def one_rank_group():
    group = TensorParallelGroup(0, 1, RendezvousAddress.on_localhost(), torch.device("cpu"))
    yield group
    group.close()


def _step_inputs(num_kv_heads: int, head_dim: int, num_layers: int):
    from compiled_engine.records.scheduler_output import ScheduledRequest, SchedulerOutput
    from compiled_engine.worker.input_buffers import InputBuffers

    buffers = InputBuffers(64, 4, 64, 16, torch.device("cpu"))
    requests = tuple(
        ScheduledRequest(
            request_id=f"r{i}",
            token_ids=tuple(range(3 + i, 9 + 2 * i)),
            start_position=0,
            block_ids=(i,),
            sample=True,
            sampling_params=SamplingParams(temperature=0),
            num_output_tokens=0,
        )
        for i in range(2)
    )
    step = SchedulerOutput(requests, sum(len(r.token_ids) for r in requests), (), ())
    caches = [torch.zeros(2, 8, 16, num_kv_heads, head_dim) for _ in range(num_layers)]
    return buffers.prepare(step).inputs, caches


def test_pass_inserts_a_collective_per_communicating_module(llama_dir, one_rank_group):
    loaded = load_model(llama_dir, tensor_parallel=(0, 1))
    mc = loaded.model_config
    inputs, caches = _step_inputs(mc.num_kv_heads, mc.head_dim, mc.num_layers)
    plain = capture_model(load_model(llama_dir).model, [c.clone() for c in caches])
    sharded = capture_model(loaded.model, caches, tensor_parallel=loaded.tensor_parallel)
    with torch.inference_mode():
        expected = plain(inputs)
        logits = sharded(inputs)
    gm = sharded.graphs[0]
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    # o_proj and down_proj per layer plus the embedding: all-reduce; the LM head: all-gather.
    assert targets.count(ALL_REDUCE) == 2 * mc.num_layers + 1
    assert targets.count(ALL_GATHER) == 1
    result = sharded.pass_log[0].result("tensor_parallel")
    assert result.nodes_rewritten == 2 * mc.num_layers + 2
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_pass_refuses_a_graph_missing_a_module_that_must_communicate(llama_dir, one_rank_group):
    loaded = load_model(llama_dir, tensor_parallel=(0, 1))
    layout = loaded.tensor_parallel
    broken = dataclasses.replace(layout, communicating_modules=(("model.extra_proj", "rowwise"),))
    mc = loaded.model_config
    inputs, caches = _step_inputs(mc.num_kv_heads, mc.head_dim, mc.num_layers)
    captured = capture_model(loaded.model, caches, tensor_parallel=broken)
    with pytest.raises(LoweringError, match=r"no node for module\(s\) \['model.extra_proj'\]"):
        captured(inputs)
    # A hash of the pass's and the layout's sources (kernels/source_version.py).
    assert re.fullmatch(r"[0-9a-f]{16}", ShardForTensorParallel(layout).version)


# -- 2-rank engines (gloo on CPU) -------------------------------------------------------------------


def _prompts(vocab: int, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]}
        for _ in range(count)
    ]


ENGINE = dict(
    device="cpu",
    max_num_seqs=4,
    max_model_len=64,
    num_kv_blocks=48,
    compile_buckets=(1, 2, 4),
    enable_prefix_caching=False,
)


@pytest.mark.parametrize(
    "arch",
    [
        # Both slow (the default run's time budget): 2 ranks stay in the default run eager, in
        # test_the_cli_generates_the_same_text_with_two_ranks and the worker-lifecycle tests below.
        pytest.param("llama", marks=pytest.mark.slow),
        pytest.param("qwen3", marks=pytest.mark.slow),
    ],
)
def test_two_ranks_compiled_match_one_rank(model_dirs, arch):
    model_dir = model_dirs[arch]
    prompts = _prompts(384, 10, seed=3)
    # A penalised request and one with prompt logprobs: their sampling state reaches every rank,
    # and prompt logprobs take the dynamic graph.
    extra = [
        (prompts[0], SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3)),
        (prompts[1], SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1)),
    ]
    single = LLM(model_dir, **ENGINE)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    expected_extra = [single.generate([p], s, use_tqdm=False)[0] for p, s in extra]
    del single

    llm = LLM(model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        assert isinstance(llm.engine.model_runner.step_graph, CompiledStep)  # compiled mode on rank 0
        workers = _tp_workers()
        assert len(workers) == 1 and workers[0].is_alive()
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert outputs == expected
        for (prompt, params), reference in zip(extra, expected_extra, strict=True):
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference.outputs[0].token_ids
            if params.prompt_logprobs:
                ours = [next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]]
                theirs = [next(iter(e.values())).logprob for e in reference.prompt_logprobs[1:]]
                assert ours == pytest.approx(theirs, abs=1e-5)
        assert llm.engine.num_free_kv_blocks() == llm.engine.num_kv_blocks
        # No step plans on a rank: recording one runs the step, and its collectives, again.
        assert llm.engine.model_runner.step_graph.decode_graphs.graphs is None
    finally:
        llm.close()
    _assert_nothing_left()


def test_a_killed_worker_stops_the_engine_with_a_clear_error_at_once(llama_dir):
    llm = LLM(llama_dir, tensor_parallel_size=2, enforce_eager=True, **ENGINE)
    try:
        prompts = _prompts(384, 3, seed=5)
        assert len(llm.generate(prompts, GREEDY, use_tqdm=False)) == 3
        (worker,) = _tp_workers()
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(
            TensorParallelWorkerError, match=r"worker rank 1 \(pid \d+\) exited with code -9 \(SIGKILL\)"
        ):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 10
        # The engine stays down, and says so at once.
        started = time.monotonic()
        with pytest.raises(TensorParallelWorkerError, match="cannot run steps any more"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 2
    finally:
        llm.close()
    _assert_nothing_left()


def test_no_worker_outlives_the_engine(llama_dir):
    llm = LLM(llama_dir, tensor_parallel_size=2, enforce_eager=True, **ENGINE)
    pids = [p.pid for p in _tp_workers()]
    assert len(pids) == 1 and _alive(pids[0])
    del llm
    gc.collect()
    assert _wait_gone(pids) == []
    assert not dist.is_initialized()


def test_a_failed_start_leaves_no_worker_behind(llama_dir):
    # Every rank rejects the option; rank 0 reports its own error and ends the workers.
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        LLM(llama_dir, tensor_parallel_size=2, enforce_eager=True, **{**ENGINE, "max_model_len": 100_000})
    assert _wait_gone([p.pid for p in _tp_workers()]) == []
    _assert_nothing_left()
    with pytest.raises(UnsupportedModelError, match="not divisible by tensor_parallel_size=3"):
        LLM(llama_dir, tensor_parallel_size=3, enforce_eager=True, **ENGINE)
    assert not _tp_workers()
    with pytest.raises(ValueError, match="async_scheduling=True is not supported"):
        LLM(llama_dir, tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int, got 0"):
        LLM(llama_dir, tensor_parallel_size=0, **ENGINE)


@pytest.mark.slow  # two ranks started by the console script (~24 s); the default run tests 2 ranks in-process
def test_the_cli_generates_the_same_text_with_two_ranks(llama_dir, capsys):
    # The console script is the spawned workers' parent here: its main module must be import-safe.
    import subprocess
    import sys
    from pathlib import Path

    from compiled_engine.entrypoints import cli as cli_module

    argv = ["generate", "def add(a, b):", "--model", llama_dir, "--max-tokens", "12"]
    argv += ["--enforce-eager", "--device", "cpu", "--tensor-parallel-size"]
    # One rank spawns nothing: the same CLI code in this process gives the reference text.
    assert cli_module.main([*argv, "1"]) == 0
    texts = [capsys.readouterr().out]
    cli = Path(sys.executable).parent / "compiled-engine"
    proc = subprocess.run([str(cli), *argv, "2"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    texts.append(proc.stdout)
    assert texts[0] == texts[1] and texts[0].startswith("def add(a, b):")


def test_workers_exit_when_rank_0_is_killed(llama_dir, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "rank0.py"
    script.write_text(
        "import multiprocessing, sys, time\n"
        "from compiled_engine import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({llama_dir!r}, tensor_parallel_size=2, enforce_eager=True, device='cpu',\n"
        "              max_model_len=64, num_kv_blocks=16)\n"
        "    print(*[p.pid for p in multiprocessing.active_children()], flush=True)\n"
        "    time.sleep(600)\n"
    )
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker_pids = [int(pid) for pid in rank0.stdout.readline().split()]
        assert worker_pids and all(_alive(pid) for pid in worker_pids)
        rank0.kill()  # SIGKILL: no cleanup code of rank 0 runs
        rank0.wait(timeout=30)
        assert _wait_gone(worker_pids, timeout_s=15) == []
    finally:
        rank0.kill()
