"""The server with its engine in a process of its own (ProcessAsyncLLM), over real HTTP with the
official `openai` client: it serves what the in-process engine serves, a bad request is a 400 that
leaves the others running, a dead engine process is a clear 503 and a clean shutdown, a server that
dies takes its engine process with it, and an engine that cannot be built fails the start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import openai
import pytest
import torch

from compiled_engine.engine.async_llm import AsyncLLM
from compiled_engine.engine.engine_process import engine_environment, serving_defaults
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.process_async_llm import ProcessAsyncLLM
from compiled_engine.engine_args import SERVING_LONG_PREFILL_DEFAULT, EngineArgs
from compiled_engine.entrypoints.openai.api_server import build_app
from compiled_engine.errors import ModelLoadError
from tests.test_server import ENGINE_OPTIONS, GREEDY, ServerThread, _error, _get

MODEL = "tiny"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent reaps it).
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def process_server(llama_dir):
    engine = ProcessAsyncLLM.start(EngineArgs(model=llama_dir, **ENGINE_OPTIONS))
    server = ServerThread(build_app(engine, served_model_names=[MODEL]))
    yield server, engine
    server.stop()  # the app's lifespan shuts the engine down
    assert not engine.is_running
    assert not _pid_alive(engine.pid), "the engine process outlived its shutdown"


def test_streams_and_bad_requests_as_in_process(process_server, llama_dir):
    server, engine = process_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = [5, 6, 7, 8, 9]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    # The same greedy text as the engine in this process gives.
    local = AsyncLLM(LLMEngine(EngineArgs(model=llama_dir, **ENGINE_OPTIONS)))
    try:
        reference = build_app(local, served_model_names=[MODEL], shutdown_engine_on_exit=False)
        reference_server = ServerThread(reference)
        try:
            ref_client = openai.OpenAI(base_url=f"{reference_server.url}/v1", api_key="unused", max_retries=0)
            expected = ref_client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        finally:
            reference_server.stop()
    finally:
        local.shutdown()
    assert whole.choices[0].text == expected.choices[0].text

    # A token id outside the vocabulary: the engine process refuses it, a 400 naming it...
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5, 10**7], max_tokens=2)
    assert "vocabulary" in _error(info.value)["message"]
    # ...and keeps serving the next request.
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    assert again.choices[0].text == whole.choices[0].text
    assert _get(f"{server.url}/health")[0] == 200
    assert json.loads(_get(f"{server.url}/ready")[1])["serving"] is True


def test_a_killed_engine_process_is_a_clear_503_and_a_clean_shutdown(llama_dir):
    engine = ProcessAsyncLLM.start(EngineArgs(model=llama_dir, **ENGINE_OPTIONS))
    server = ServerThread(build_app(engine, served_model_names=[MODEL]))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(
            model=MODEL, prompt=[5, 6, 7], max_tokens=200, stream=True, **GREEDY
        )
        next(iter(stream))
        os.kill(engine.pid, signal.SIGKILL)
        # The stream in flight ends with the engine's error (an SSE error event), not a hang.
        with pytest.raises(openai.APIError, match="engine process exited unexpectedly"):
            list(stream)
        deadline = time.monotonic() + 30
        while _get(f"{server.url}/health")[0] != 503:
            assert time.monotonic() < deadline, "/health never turned 503"
            time.sleep(0.05)
        status, body = _get(f"{server.url}/health")
        assert json.loads(body)["error"]["type"] == "engine_dead_error"
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)
        assert info.value.status_code == 503
        assert "engine process exited unexpectedly" in _error(info.value)["message"]
    finally:
        server.stop()
    assert not engine.is_running and not _pid_alive(engine.pid)


def test_a_model_that_cannot_be_built_fails_the_start(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        ProcessAsyncLLM.start(EngineArgs(model=str(tmp_path), **ENGINE_OPTIONS))


@pytest.mark.slow
def test_the_engine_process_leaves_when_the_server_dies(llama_dir):
    script = textwrap.dedent(
        f"""
        import time
        from compiled_engine.engine.process_async_llm import ProcessAsyncLLM
        from compiled_engine.engine_args import SERVING_LONG_PREFILL_DEFAULT, EngineArgs
        engine = ProcessAsyncLLM.start(EngineArgs(model={llama_dir!r}, **{ENGINE_OPTIONS!r}))
        print(engine.pid, flush=True)
        time.sleep(600)
        """
    )
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        engine_pid = int(server.stdout.readline())
        assert _pid_alive(engine_pid)
        server.kill()
        server.wait(30)
        deadline = time.monotonic() + 30
        while _pid_alive(engine_pid):
            assert time.monotonic() < deadline, "the engine process outlived its server"
            time.sleep(0.1)
    finally:
        if server.poll() is None:
            server.kill()


def test_the_engine_gets_a_short_openmp_spin_unless_the_user_chose_a_policy():
    assert engine_environment({"PATH": "/bin"}) == {"PATH": "/bin", "GOMP_SPINCOUNT": "1000"}
    assert engine_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert engine_environment({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}


def test_the_serving_engine_leaves_a_core_to_the_server_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert serving_defaults(EngineArgs()).cpu_reserved_cores == 1
    assert serving_defaults(EngineArgs(cpu_reserved_cores=0)).cpu_reserved_cores == 0
    assert serving_defaults(EngineArgs(cpu_reserved_cores=2)).cpu_reserved_cores == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert serving_defaults(EngineArgs()).cpu_reserved_cores == 0  # one core: nothing to spare
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert serving_defaults(EngineArgs()).cpu_reserved_cores == 0  # the user chose the threads


def test_the_serving_engine_caps_prompt_tokens_per_step_on_cpu_unless_told_otherwise():
    assert EngineArgs().long_prefill_token_threshold is None  # auto
    cpu = serving_defaults(EngineArgs(device="cpu"))
    assert cpu.long_prefill_token_threshold == SERVING_LONG_PREFILL_DEFAULT["cpu"] > 0
    assert serving_defaults(EngineArgs(device="cuda")).long_prefill_token_threshold == 0
    for chosen in (0, 7):
        args = EngineArgs(device="cpu", long_prefill_token_threshold=chosen)
        assert serving_defaults(args).long_prefill_token_threshold == chosen
    for bad in (-1, 1.5, True, "32"):
        with pytest.raises(ValueError, match="long_prefill_token_threshold must be an int >= 0"):
            EngineArgs(long_prefill_token_threshold=bad)


def test_reserved_cores_lower_the_step_threads(llama_dir):
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        LLMEngine(EngineArgs(model=llama_dir, enforce_eager=True, num_kv_blocks=8, cpu_reserved_cores=1))
        assert torch.get_num_threads() == max(1, cores - 1)
    finally:
        torch.set_num_threads(threads)
