"""The prepared device check (bench/gpu_check.py) runs end to end on CPU at its --quick sizes.

It runs in a subprocess exactly as a GPU session would launch it, so argument parsing, the
report file, the section guards and the exit status are all exercised.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


# Every section but "Tensor parallel, 2 ranks vs 1" (a third of the run): the default run checks the
# same 2-rank compiled engine against one rank on gloo in tests/test_tensor_parallel.py
# (test_two_ranks_compiled_match_one_rank[qwen3]); the section itself runs under -m slow below.
ALL_BUT_TENSOR_PARALLEL = "environment,attention,graphs,models,engine start,parity,timings,quantized"


def _quick(tmp_path_factory, only: str):
    out = tmp_path_factory.mktemp("gpu-check") / "report.md"
    # The environment (TORCHINDUCTOR_CACHE_DIR from tests/conftest.py included) is inherited.
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick", "--out", str(out)]
        + ["--only", only],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, out


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    return _quick(tmp_path_factory, ALL_BUT_TENSOR_PARALLEL)


@pytest.fixture(scope="module")
def quick_tensor_parallel_run(tmp_path_factory):
    return _quick(tmp_path_factory, "tensor parallel")


def test_quick_run_passes_parity_eager_and_compiled(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    for mode in ("eager", "compiled"):
        line = re.search(rf"^- parity tiny-llama float32 {mode}: (.*)$", proc.stdout, re.MULTILINE)
        assert line, f"no {mode} parity line in:\n{proc.stdout}"
        assert "4 prompts" in line.group(1)
        assert " 0 unexcused divergences" in line.group(1)
    assert "ERROR" not in proc.stdout
    # The report file holds the same markdown as stdout.
    assert out.read_text(encoding="utf-8") == proc.stdout


def test_quick_run_reports_environment_backends_and_timings(quick_run):
    proc, _ = quick_run
    report = proc.stdout
    assert re.search(r"^- torch \S+ .*transformers \S+", report, re.MULTILINE)
    # Every backend is listed with its version or why it cannot run here.
    assert re.search(r"^- torch: [0-9a-f]{16}(\+[0-9a-f]{16})*$", report, re.MULTILINE)
    assert re.search(r"^- flashinfer: unavailable: .*flashinfer", report, re.MULTILINE)
    assert re.search(r"^- triton: ([0-9a-f]{16}\+triton-\S+|unavailable: .+)$", report, re.MULTILINE)
    assert re.search(r"^- CUDA graphs .*: one per decode bucket", report, re.MULTILINE)
    # Each runnable backend against the reference, and its decode timings.
    parity_rows = re.findall(
        r"^\| (torch|triton) \| (float32|float16) \| .* \| (ok|FAIL) \|$", report, re.MULTILINE
    )
    assert parity_rows and all(ok == "ok" for *_, ok in parity_rows), report
    assert {"float32", "float16"} <= {dtype for _, dtype, _ in parity_rows}
    timing_rows = re.findall(r"^\| (torch|triton) \| (\d+) \| 64 \| ([0-9.]+) \|", report, re.MULTILINE)
    assert {(name, batch) for name, batch, _ in timing_rows} >= {("torch", "1"), ("torch", "4")}, report
    # The engine's own start on this device, KV cache sized by the engine, a batch run, no leak.
    assert re.search(
        r"^- tiny-llama: ready in [0-9.]+ s, \d+ KV blocks sized by the engine", report, re.MULTILINE
    )
    assert "every KV block free afterwards" in report
    rows = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^\| (eager|compiled|hf generate) \| ([0-9.]+) \(", report, re.MULTILINE)
    }
    assert set(rows) == {"eager", "compiled", "hf generate"}, report
    assert all(ms > 0 for ms in rows.values())
    assert re.search(r"compile s per bucket: 16: [0-9.]+", report)
    # Where an engine step's time goes on the host, per phase, for every engine system.
    phases = re.findall(r"^- host phases, (eager|compiled), c=1: ms per step: schedule ([0-9.]+), .*"
                        r"update ([0-9.]+), outside the core ([0-9.]+)$", report, re.MULTILINE)  # fmt: skip
    assert {system for system, *_ in phases} == {"eager", "compiled"}, report
    assert "- parity failures: 0" in report


def test_quick_run_checks_bucket_graphs_through_the_cpu_runtime(quick_run):
    proc, _ = quick_run
    report = proc.stdout
    assert "### Bucket graphs\n- runtime CpuRuntime (device graphs: False)" in report
    assert "- capture order: [4, 1]" in report
    rows = {
        int(m.group(1)): m.group(2).split(" | ")
        for m in re.finditer(r"^\| (\d+) \| (.*) \|$", report, re.MULTILINE)
    }
    assert set(rows) == {1, 4}, report
    for cells in rows.values():
        compile_s, capture_s, memory, plain_ms, replay_ms, _, max_diff = cells
        assert float(plain_ms) > 0 and float(replay_ms) > 0
        assert memory == "0 KiB"  # CPU captures pin no memory
        assert float(max_diff) == 0.0  # CPU replay is the plain call
    assert "MISMATCH" not in report


class _StaleGraph:
    """A capture that replays the output it computed at capture: the bug the check must catch."""

    memory_bytes = 0

    def __init__(self, output) -> None:
        self.output = output

    def replay(self):
        return self.output


def test_bucket_graphs_section_fails_on_a_replay_that_ignores_new_inputs(monkeypatch, capsys):
    import torch

    from bench.gpu_check import Report, bucket_graphs_section
    from compiled_engine.graphs import device

    class StaleRuntime(device.CpuRuntime):
        def capture(self, fn, pool=None):
            return _StaleGraph(fn().clone())

    monkeypatch.setattr(device, "runtime_for", lambda _device: StaleRuntime())
    with pytest.raises(RuntimeError, match="bucket graph check"):
        bucket_graphs_section(torch.device("cpu"), quick=True)(Report(None))
    out = capsys.readouterr().out
    assert "- MISMATCH bucket 1: replay differs from the plain call" in out
    assert "- MISMATCH bucket 4: replay differs from the plain call" in out


def test_bad_budget_is_rejected():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--budget-s", "0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--budget-s must be positive" in proc.stderr


def test_exhausted_budget_skips_sections_with_a_note(tmp_path):
    # A budget spent before the first section: every section is listed as skipped, nothing runs.
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick", "--budget-s", "1e-9"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "- skipped: time budget of" in proc.stdout
    assert "### parity tiny-llama float32 eager\n- skipped" in proc.stdout
    assert "parity tiny-llama float32 eager:" not in proc.stdout


def test_compare_excuses_only_near_ties():
    import torch

    from bench.gpu_check import compare, tie_tolerance

    def scores(top: float, second: float) -> torch.Tensor:
        return torch.tensor([top, second, -5.0])

    refs = [
        ([0, 0], [scores(1.0, 0.0), scores(1.0, 0.0)]),  # identical
        ([0, 1], [scores(1.0, 0.0), scores(3.0, 3.0 - 1e-5)]),  # diverges at a near-tie
        ([0, 0], [scores(3.0, 2.0), scores(1.0, 0.0)]),  # diverges where the gap is 1.0
    ]
    ours = [[0, 0], [0, 0], [1, 0]]
    result = compare(ours, [[5], [6], [7]], refs, "float32")
    assert (result.identical, result.excused) == (1, 1)
    assert len(result.unexcused) == 1 and "prompt 2 (len 1) step 0" in result.unexcused[0]
    # bf16: a one-ulp tie at logit 3 (2**-6 apart) is excused; fp32's 1e-4 would not excuse it.
    assert tie_tolerance("bfloat16", 3.0) >= 2.0**-6 > tie_tolerance("float32", 3.0)
    assert tie_tolerance("bfloat16", 0.5) == 1e-2


def test_only_keeps_matching_sections_and_the_ones_they_need():
    from bench.gpu_check import ALWAYS_RUN, Section, select_sections

    def noop(report):
        return None

    titles = [*ALWAYS_RUN, "Bucket graphs", "parity tiny-qwen3 bfloat16 compiled", "3. Decode timings"]
    sections = [Section(t, "x", noop) for t in titles]
    assert select_sections(sections, None) == sections
    kept = [s.title for s in select_sections(sections, "graphs, QWEN3")]
    assert kept == [*ALWAYS_RUN, "Bucket graphs", "parity tiny-qwen3 bfloat16 compiled"]
    assert [s.title for s in select_sections(sections, "no such section")] == list(ALWAYS_RUN)


def test_error_lines_keep_python_frames_of_the_innermost_cause():
    from bench.gpu_check import error_lines

    def inner():
        raise RuntimeError("Cannot call numel()\n" + "".join(f"frame #{i}: c10\n" for i in range(4)))

    try:
        try:
            inner()
        except RuntimeError as cause:
            raise ValueError("backend failed") from cause
    except ValueError as exc:
        lines = error_lines(exc)
    assert lines[0] == "- ERROR: ValueError: backend failed"
    assert "innermost: RuntimeError: Cannot call numel()" in lines
    assert any(" in inner: " in line for line in lines)
    assert not any("frame #3" in line for line in lines)


def test_the_default_quick_run_leaves_out_only_the_multi_process_sections(quick_run, tmp_path):
    import torch

    from bench.gpu_check import Budget, parse_args, plan_sections

    proc, _ = quick_run
    assert "### Tensor parallel" not in proc.stdout
    planned = {s.title for s in plan_sections(parse_args(["--device", "cpu", "--quick"]), torch.device("cpu"),
                                                Budget(60.0), tmp_path)}  # fmt: skip
    run = set(re.findall(r"^### (.*)$", proc.stdout, re.MULTILINE))
    # Pipeline parallelism's section too: tests/test_pipeline_parallel.py checks the same engine.
    assert planned - run == {"Tensor parallel, 2 ranks vs 1", "Pipeline parallel, 2 stages vs 1"}, (
        planned,
        run,
    )


@pytest.mark.slow
def test_quick_run_checks_tensor_parallel_on_gloo(quick_tensor_parallel_run):
    proc, _ = quick_tensor_parallel_run
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "### Tensor parallel, 2 ranks vs 1" in proc.stdout
    assert "- TP=2 vs TP=1: 4 of 4 prompts identical" in proc.stdout
