"""data_parallel_size: engine replicas (real engine processes) behind one real server on 127.0.0.1,
driven by the official `openai` client; a replica killed mid-run fails only its own requests and
is replaced while the other keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from compiled_engine.engine.data_parallel import DataParallelAsyncLLM, replica_args
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_args import EngineArgs
from compiled_engine.entrypoints.openai.api_server import build_app
from tests.test_server import ENGINE_OPTIONS, GREEDY, ServerThread, _get, _metrics

MODEL = "tiny"
PROMPT = [5, 9, 12, 3, 7]


async def _stream(client: openai.AsyncOpenAI, max_tokens: int) -> tuple[str, int]:
    """The streamed text and the completion tokens usage counted."""
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    text, tokens = [], 0
    async for chunk in stream:
        text += [c.text for c in chunk.choices]
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), tokens


async def _streams(url: str, count: int, max_tokens: int, during=None) -> list:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        tasks = [asyncio.create_task(_stream(client, max_tokens)) for _ in range(count)]
        if during is not None:
            await during()
        return await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await client.close()


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow  # three engine processes start (~50 s): the default run's budget
def test_replicas_share_64_streams_and_a_killed_one_fails_alone_then_returns(llama_dir):
    engine = DataParallelAsyncLLM.start(EngineArgs(model=llama_dir, data_parallel_size=2, **ENGINE_OPTIONS))
    server = ServerThread(build_app(engine, served_model_names=[MODEL]))
    try:
        first_pids = engine.replica_pids()
        assert len(set(first_pids)) == 2 and all(first_pids)

        results = asyncio.run(_streams(server.url, 64, 24))
        assert all(isinstance(r, tuple) and r[1] == 24 for r in results), results[:3]
        # Greedy and one model: every stream, whichever replica ran it, got the same tokens.
        assert all(r == results[0] for r in results)
        assert all(r is not None and r.stats().num_steps > 0 for r in engine.replicas())  # both served
        metrics = _metrics(server.url)
        assert metrics["compiled_engine:engine_healthy{engine=0}"] == 1
        assert metrics["compiled_engine:engine_healthy{engine=1}"] == 1

        # Prompts sharing a 80-token head go to one replica, whose prefix cache then serves them.
        shared = list(range(3, 83))
        hits_before = [r.stats().prefix_cache_hits for r in engine.replicas() if r is not None]

        async def shared_prefix_requests() -> None:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            try:
                for tail in range(6):
                    await client.completions.create(
                        model=MODEL, prompt=[*shared, 90 + tail], max_tokens=2, **GREEDY
                    )
            finally:
                await client.close()

        asyncio.run(shared_prefix_requests())
        assert engine.num_affine_picks == 5
        gained = [
            r.stats().prefix_cache_hits - h for r, h in zip(engine.replicas(), hits_before, strict=True)
        ]
        assert sorted(gained)[0] == 0 and sorted(gained)[1] >= 5 * 64, gained

        victim = first_pids[0]

        async def kill_replica_0_mid_run() -> None:
            replica = engine.replicas()[0]
            while replica.stats().num_running == 0:  # its share of the streams is running
                await asyncio.sleep(0.01)
            os.kill(victim, signal.SIGKILL)

        results = asyncio.run(_streams(server.url, 16, 200, during=kill_replica_0_mid_run))
        failed = [r for r in results if isinstance(r, BaseException)]
        finished = [r for r in results if isinstance(r, tuple)]
        assert failed and finished, results  # only the dead replica's streams failed
        assert all(r[1] == 200 for r in finished)
        assert all(isinstance(e, openai.APIError) for e in failed), failed
        assert _get(f"{server.url}/health")[0] == 200  # the other replica serves on

        _wait_for(lambda: engine.replica_pids()[0] not in (None, victim), 120)
        assert engine.num_restarts == [1, 0]
        assert engine.replica_pids()[1] == first_pids[1]
        results = asyncio.run(_streams(server.url, 8, 24))
        assert all(isinstance(r, tuple) and r[1] == 24 for r in results), results
        assert engine.replicas()[0].stats().num_steps > 0  # the new replica took its share
    finally:
        server.stop()
    assert not any(_pid_alive(pid) for pid in engine.replica_pids() if pid is not None)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_one_engine_is_one_replica():
    with pytest.raises(ValueError, match="data_parallel_size > 1 runs replicas behind `compiled-engine"):
        LLMEngine(EngineArgs(data_parallel_size=2))


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_bad_data_parallel_size_is_refused(value):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive int"):
        EngineArgs(data_parallel_size=value)


def test_replicas_split_the_cores_left_to_them(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(9)))
    # 9 cores: one for the server, 4 threads per replica (each leaves 5 to the rest).
    one = replica_args(EngineArgs(data_parallel_size=2), 2)
    assert one.data_parallel_size == 1 and one.cpu_reserved_cores == 5
    assert replica_args(EngineArgs(data_parallel_size=2, cpu_reserved_cores=0), 2).cpu_reserved_cores == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert replica_args(EngineArgs(data_parallel_size=2), 2).cpu_reserved_cores == 1  # a thread each


def test_a_replica_on_ray_places_its_workers_with_ray_and_a_local_one_spawns_them():
    # A served engine on Ray places its pipeline stages / TP ranks with Ray too (possibly on other
    # nodes); a local replica spawns them on this machine.
    on_ray = replica_args(EngineArgs(pipeline_parallel_size=2, distributed_executor_backend="ray"), 1)
    assert (on_ray.distributed_executor_backend, on_ray.pipeline_parallel_size) == ("ray", 2)
    local = replica_args(EngineArgs(pipeline_parallel_size=2), 1)
    assert local.distributed_executor_backend == "mp"


def test_an_unknown_executor_backend_is_refused():
    with pytest.raises(
        ValueError, match="unknown distributed_executor_backend 'slurm': choose one of mp, ray"
    ):
        EngineArgs(distributed_executor_backend="slurm")
