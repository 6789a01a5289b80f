"""compile_policy="background": a cold engine serves at once on fallback graphs while a real
compiler process (worker/graph_compiler_process.py) builds the missing graphs, and no step ever
waits on the request path for a compile or a load (the step timeline says so). Plus the three
failures that must stay warnings: an unwritable cache dir, a killed compiler, a corrupt artifact."""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import weakref

import openai
import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.engine.async_llm import AsyncLLM
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_args import EngineArgs
from compiled_engine.entrypoints.openai.api_server import build_app
from compiled_engine.graphs.background_builds import COMPILED, FAILED, LOADING
from compiled_engine.graphs.inductor_warmup import InductorProbes
from compiled_engine.worker.cpu_cores import split_cores
from tests.test_server import ServerThread, _get, _metrics

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
# Buckets 1, 4, 16 and the dynamic graph (steps above 16 tokens, up to the 32-token budget).
BUCKETS = (1, 4, 16)
SETTINGS = dict(
    dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, compile_buckets=BUCKETS
)
# Batches whose steps walk every graph: prefills of 3, 3x4=12 (bucket 16) and 25+ tokens (the
# dynamic graph; chunked at 32), decodes of 1 and 2-4 sequences (buckets 1 and 4).
WORKLOAD = (
    ["def add(a, b):"],
    ["x = 1", "y = 2", "print(x)", "z = x + y"],
    ["import os\nimport sys\nimport json\nimport time\nimport math\nimport re"],
    ["class A:\n    pass", "for i in range(10):\n    print(i)"],
)


def _run(llm: LLM, batches=WORKLOAD) -> list[list[list[int]]]:
    return [
        [list(o.outputs[0].token_ids) for o in llm.generate(list(batch), GREEDY, use_tqdm=False)]
        for batch in batches
    ]


@pytest.fixture(scope="module")
def eager_tokens(llama_dir):
    llm = LLM(llama_dir, enforce_eager=True, **{k: v for k, v in SETTINGS.items() if k != "compile_buckets"})
    return _run(llm)


def _background(llama_dir, cache_dir, **kwargs) -> LLM:
    return LLM(llama_dir, cache_dir=str(cache_dir), compile_policy="background", **{**SETTINGS, **kwargs})


def test_a_cold_engine_never_waits_on_a_compile_and_matches_eager(
    tmp_path, llama_dir, eager_tokens, monkeypatch
):
    # Inductor's CPU probes (~15 s on a cold Inductor cache) are waited for only before the first
    # graph load, never by a start that loads nothing (graphs/inductor_warmup.py).
    probe_waits = []
    real_wait = InductorProbes.wait
    monkeypatch.setattr(InductorProbes, "wait", lambda self: probe_waits.append(1) or real_wait(self))
    threads = torch.get_num_threads()
    llm = _background(llama_dir, tmp_path)
    assert probe_waits == []
    step = llm.engine.model_runner.step_graph
    assert step.background is not None
    if threads > 1:  # a step leaves the running compiler a core, and puts it back afterwards
        with step._sharing_cores():
            assert torch.get_num_threads() == threads - 1
    first = _run(llm)
    stats = llm.stats()
    assert first == eager_tokens
    assert torch.get_num_threads() == threads
    assert stats.graph_waits == ()
    assert stats.num_fallback_steps > 0  # the steps ran while their graphs were still compiling

    assert step.background.wait_until_built(timeout=600)
    assert step.status().failed == 0
    assert _run(llm) == eager_tokens  # its steps ask for their graphs: loaded off the step path
    deadline = time.monotonic() + 120
    while llm.stats().graphs.compiled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _run(llm) == eager_tokens  # the loaded graphs are swapped in between steps
    stats = llm.stats()
    assert stats.graph_waits == ()
    assert stats.graphs.ready == stats.graphs.total == 4 and stats.graphs.all_built
    assert probe_waits  # the loads waited for the probes first
    walked = set()
    before = stats.num_fallback_steps
    for batch in WORKLOAD:
        llm.generate(list(batch), GREEDY, use_tqdm=False)
        walked.add(step.last_call.ran)
    assert llm.stats().num_fallback_steps == before  # every step now runs its own graph
    assert {"1", "4"} <= walked

    # Warm start, in a second process with the same cache: every graph is loaded before LLM()
    # returns, so the request path loads nothing and runs no fallback.
    script = textwrap.dedent(
        f"""
        import json
        from compiled_engine import LLM, SamplingParams
        llm = LLM({llama_dir!r}, cache_dir={str(tmp_path)!r}, compile_policy="background", **{SETTINGS!r})
        status = llm.stats().graphs
        tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(list(b), SamplingParams(temperature=0.0,
                  max_tokens=6), use_tqdm=False)] for b in {WORKLOAD!r}]
        stats = llm.stats()
        print(json.dumps(dict(ready=status.ready, total=status.total, tokens=tokens,
                              waits=len(stats.graph_waits), fallbacks=stats.num_fallback_steps,
                              background=llm.engine.model_runner.step_graph.background is not None)))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warm = json.loads(proc.stdout.strip().splitlines()[-1])
    assert warm["ready"] == warm["total"] == 4
    assert warm["waits"] == 0 and warm["fallbacks"] == 0 and warm["background"] is False
    assert warm["tokens"] == eager_tokens


def test_blocking_policy_records_the_step_that_waited(tmp_path, built_cache, llama_dir, eager_tokens):
    cache = _copy_without(built_cache, tmp_path, "bucket-1")
    llm = LLM(llama_dir, cache_dir=str(cache), compile_policy="blocking", **SETTINGS)
    assert llm.stats().graphs.on_demand == 1
    assert _run(llm) == eager_tokens
    # The first one-sequence decode compiled bucket 1 on the request path: a stall, on the timeline.
    (wait,) = llm.stats().graph_waits
    assert (wait.graph, wait.kind) == ("1", "compile") and wait.seconds > 0
    assert llm.stats().longest_graph_wait_s == wait.seconds
    assert llm.stats().num_fallback_steps == 0 and llm.stats().graphs.all_built


def _copy_without(built_cache, tmp_path, *names: str):
    """A copy of the built cache without these graphs' artifacts."""
    cache = tmp_path / "cache"
    shutil.copytree(built_cache, cache)
    (entry,) = (cache / "entries").iterdir()
    for name in names:
        (entry / f"{name}.artifact").unlink()
    return cache


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory, llama_dir):
    """A compile cache holding every graph of SETTINGS, built before LLM() returned ("ahead")."""
    root = tmp_path_factory.mktemp("built-cache")
    llm = LLM(llama_dir, cache_dir=str(root), compile_policy="ahead", **SETTINGS)
    assert llm.stats().graphs.ready == llm.stats().graphs.total == 4
    return root


def test_a_killed_compiler_is_a_warning_and_steps_keep_their_fallback(
    tmp_path, llama_dir, eager_tokens, caplog
):
    llm = _background(llama_dir, tmp_path)
    background = llm.engine.model_runner.step_graph.background
    os.kill(background.pid, signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="compiled_engine.graphs.background_builds"):
        assert background.wait_until_built(timeout=60)
    assert "killed by signal 9" in caplog.text
    status = llm.stats().graphs
    assert status.failed + status.ready == status.total and status.failed > 0
    assert _run(llm) == eager_tokens
    assert llm.stats().graph_waits == ()


def test_an_unwritable_cache_dir_is_a_warning_and_the_engine_serves(
    tmp_path, llama_dir, eager_tokens, caplog
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="compiled_engine.graphs.compile_cache"):
        llm = _background(llama_dir, blocker / "cache")
    assert "is not writable" in caplog.text
    assert _run(llm) == eager_tokens
    assert llm.stats().graph_waits == ()
    llm.close()


def test_a_corrupt_artifact_found_mid_run_is_a_warning_and_its_steps_fall_back(
    tmp_path, built_cache, llama_dir, eager_tokens, caplog
):
    cache = _copy_without(built_cache, tmp_path, "bucket-16")  # the one graph the compiler builds
    llm = _background(llama_dir, cache)
    step = llm.engine.model_runner.step_graph
    assert step.status().ready == 3
    assert step.num_traces == 0  # the dynamic graph is loaded: every step has a compiled fallback
    assert step.background.wait_until_built(timeout=600)
    assert step.background.state(16) == COMPILED  # compiled; no step has asked for it yet
    path = step.cache_entry.artifact_path("bucket-16")
    path.write_bytes(path.read_bytes()[:100])  # the artifact goes bad while the engine runs
    with caplog.at_level(logging.WARNING):
        tokens = _run(llm)  # its first step asks for bucket 16: the loader finds it corrupt
        deadline = time.monotonic() + 60
        while step.background.state(16) == LOADING and time.monotonic() < deadline:
            time.sleep(0.05)
    assert tokens == eager_tokens
    assert step.background.state(16) == FAILED
    assert "bucket-16.artifact is unusable" in caplog.text
    assert "graph 16 was compiled in the background but its artifact could not be loaded" in caplog.text
    assert _run(llm) == eager_tokens  # bucket-16 steps keep running on a fallback graph
    stats = llm.stats()
    assert stats.graphs.failed == 1 and stats.graphs.ready == 3 and stats.graph_waits == ()


def test_the_server_serves_while_compiling_and_reports_its_graphs(
    tmp_path, built_cache, llama_dir, eager_tokens
):
    cache = _copy_without(built_cache, tmp_path, "dynamic")  # one graph left for the compiler process
    args = EngineArgs(model=llama_dir, cache_dir=str(cache), compile_policy="background", **SETTINGS)
    engine = AsyncLLM(LLMEngine(args))
    server = ServerThread(build_app(engine, served_model_names=["tiny"]))
    try:
        assert _get(f"{server.url}/health")[0] == 200
        status, body = _get(f"{server.url}/ready")
        ready = json.loads(body)
        assert status == 200 and ready["serving"] is True
        graphs = ready["graphs"]
        assert graphs["policy"] == "background" and graphs["total"] == 4 and graphs["ready"] == 3
        assert graphs["queued"] + graphs["compiling"] + graphs["compiled"] + graphs["failed"] == 1
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, expected in zip(WORKLOAD[2], eager_tokens[2], strict=True):
            done = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.0)
            assert done.choices[0].text == engine.tokenizer.decode(expected)
        assert engine.graph_status().total == 4
        assert llm_background(engine).wait_until_built(timeout=600)
        metrics = _metrics(server.url)
        assert metrics["compiled_engine:graphs{state=failed}"] == 0
        assert (
            metrics["compiled_engine:graphs{state=queued}"]
            == metrics["compiled_engine:graphs{state=compiling}"]
            == 0
        )
        assert metrics["compiled_engine:graph_wait_steps_total{}"] == 0
    finally:
        server.stop()


def llm_background(engine: AsyncLLM):
    return engine._engine.model_runner.step_graph.background


def test_dropping_the_engine_stops_its_compiler_and_frees_the_model(tmp_path, built_cache, llama_dir):
    threads = torch.get_num_threads()
    try:
        llm = _background(llama_dir, _copy_without(built_cache, tmp_path, "bucket-4"), cpu_reserved_cores=1)
    finally:
        torch.set_num_threads(threads)  # the engine sized this thread's count to its step cores
    step = weakref.ref(llm.engine.model_runner.step_graph)
    process = llm.engine.model_runner.step_graph.background.process
    # The compiler runs niced from its start, and on the reserved core, off the step threads'.
    assert os.getpriority(os.PRIO_PROCESS, process.pid) == 19
    reserved = split_cores(1).other
    assert os.sched_getaffinity(process.pid) == set(reserved or os.sched_getaffinity(0))
    del llm
    gc.collect()
    assert step() is None  # the background threads hold no reference to the step or its model
    assert process.wait(timeout=30) is not None
