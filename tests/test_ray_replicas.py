"""distributed_executor_backend="ray" on Ray's own test cluster of two simulated nodes
(`ray.cluster_utils.Cluster`): engine replicas as Ray actors behind a real server on 127.0.0.1
driven by the official `openai` client, and tensor-parallel workers as Ray actors."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from compiled_engine import LLM, SamplingParams
from compiled_engine.engine.data_parallel import DataParallelAsyncLLM
from compiled_engine.engine_args import EngineArgs
from compiled_engine.entrypoints.openai.api_server import build_app
from tests.test_data_parallel import MODEL, PROMPT, _streams, _wait_for
from tests.test_server import ENGINE_OPTIONS, ServerThread, _get

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402


def _engine_actors(name: str = "EngineActor") -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"ray::{name}"], capture_output=True, text=True)
    return found.stdout.split()


@pytest.fixture(scope="module")
def two_node_cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow  # a Ray cluster and three engine actors (~1 min)
def test_ray_replicas_on_two_nodes_match_one_engine_and_a_killed_one_comes_back(two_node_cluster, llama_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    local = LLM(llama_dir, **ENGINE_OPTIONS)
    expected = local.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0].text
    del local

    args = EngineArgs(
        model=llama_dir, data_parallel_size=2, distributed_executor_backend="ray", **ENGINE_OPTIONS
    )
    engine = DataParallelAsyncLLM.start(args)
    server = ServerThread(build_app(engine, served_model_names=[MODEL]))
    try:
        nodes = [r.node_id for r in engine.replicas()]
        assert None not in nodes and len(set(nodes)) == 2  # Ray spread them over both nodes
        results = asyncio.run(_streams(server.url, 16, 24))
        assert all(r == (expected, 24) for r in results), results[:2]
        assert all(r is not None and r.stats().num_steps > 0 for r in engine.replicas())

        victim = engine.replicas()[0]
        before = engine.replica_pids()

        async def kill_replica_0_mid_run() -> None:
            while victim.stats().num_running == 0:
                await asyncio.sleep(0.01)
            ray.kill(victim._process.actor)

        results = asyncio.run(_streams(server.url, 16, 200, during=kill_replica_0_mid_run))
        failed = [r for r in results if isinstance(r, BaseException)]
        finished = [r for r in results if isinstance(r, tuple)]
        assert failed and finished, results
        assert all(r[1] == 200 for r in finished)
        assert _get(f"{server.url}/health")[0] == 200
        _wait_for(lambda: engine.replicas()[0] not in (None, victim), 180)
        assert engine.replica_pids()[1] == before[1]
        results = asyncio.run(_streams(server.url, 8, 24))
        assert all(r == (expected, 24) for r in results), results
    finally:
        server.stop()
    deadline = time.monotonic() + 30
    while _engine_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _engine_actors() == [], "an engine actor outlived the server"


@pytest.mark.slow  # a Ray cluster and a worker actor
def test_tensor_parallel_workers_on_ray_match_one_process(two_node_cluster, model_dirs):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [8, 1, 4]}]
    options = dict(dtype="float32", enforce_eager=True, num_kv_blocks=32)
    single = LLM(model_dirs["llama"], **options)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, greedy, use_tqdm=False)]
    del single
    llm = LLM(model_dirs["llama"], tensor_parallel_size=2, distributed_executor_backend="ray", **options)
    try:
        assert _engine_actors("TensorParallelActor")  # rank 1 runs in a Ray actor
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.close()
    assert got == expected
    deadline = time.monotonic() + 30
    while _engine_actors("TensorParallelActor") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _engine_actors("TensorParallelActor") == []


@pytest.mark.slow  # a Ray cluster, an engine actor, and its stage-1 actor placed on the other node
def test_a_served_engine_on_ray_places_its_second_stage_on_the_other_node(two_node_cluster, llama_dir):
    from ray.util import placement_group_table

    from compiled_engine.engine.data_parallel import replica_args, replica_starter

    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    local = LLM(llama_dir, **ENGINE_OPTIONS)
    expected = local.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)[0].outputs[0].text
    local.close()

    # What `serve --distributed-executor-backend ray --pipeline-parallel-size 2` starts: the engine
    # in a Ray actor (1 CPU, on either node), which places its stage 1 (1 CPU) where a CPU is left.
    args = EngineArgs(
        model=llama_dir, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE_OPTIONS
    )
    engine = replica_starter(replica_args(args, 1), args.distributed_executor_backend)()
    server = ServerThread(build_app(engine, served_model_names=[MODEL]))
    try:
        (stage_1,) = [r for r in placement_group_table().values() if r["state"] == "CREATED"]
        assert stage_1["bundles_to_node_id"][0] != engine._process.node_id
        results = asyncio.run(_streams(server.url, 4, 24))
        assert all(r == (expected, 24) for r in results), results
    finally:
        server.stop()
    deadline = time.monotonic() + 30
    left = ["EngineActor", "TensorParallelActor"]
    while (any(map(_engine_actors, left)) or _created_groups()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [_engine_actors(name) for name in left] == [[], []]
    assert _created_groups() == []


def _created_groups() -> list[str]:
    from ray.util import placement_group_table

    return [pg for pg, row in placement_group_table().items() if row["state"] != "REMOVED"]
