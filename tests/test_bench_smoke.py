"""The bench suites run end to end at smoke sizes, and the report and floors compute what they claim."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import report
from bench.floors import HardwareRates, model_floors
from bench.workloads import hf_batches, mixed_requests, sizes_for
from compiled_engine.kernels import cpu_gemv, cpu_gemv_quantized
from compiled_engine.kernels.onednn_linear import onednn_linear_available

REPO = Path(__file__).resolve().parents[1]


# Suites that start servers, fresh processes or compilers: their smoke runs are the slow tests
# below, which keeps the default run's time in budget.
COMPILE_POLICY_SUITES = ("bench/test_cold_start_serving.py", "bench/test_compile_cost.py")
# Compiles a pooling body with Inductor: slow too.
EMBEDDING_SUITES = ("bench/test_embeddings.py",)
# Starts pipeline-parallel engines (worker processes) and compiles every stage: slow too.
PIPELINE_SUITES = ("bench/test_pipeline_timeline.py",)
PROCESS_SUITES = (
    "bench/test_startup.py",
    "bench/test_step_timeline.py",
    "bench/test_serving.py",
    "bench/test_structured_outputs.py",
    "bench/test_speculative.py",
)


def _run_bench_smoke(tmp_path, *args: str) -> str:
    env = dict(os.environ, COMPILED_ENGINE_BENCH_CACHE=str(tmp_path / "cache"), TQDM_DISABLE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-x", "-q", "--benchmark-disable",
         "--bench-size", "smoke", "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow  # ~90 s of compiles and HF runs: the default run's budget
def test_bench_suites_run_at_smoke_sizes(tmp_path):
    ignored = (*COMPILE_POLICY_SUITES, *PROCESS_SUITES, *EMBEDDING_SUITES, *PIPELINE_SUITES)
    stdout = _run_bench_smoke(tmp_path, "bench", *(f"--ignore={suite}" for suite in ignored))
    # ttft, decode and throughput on bench-small, each for ours and HF; the detokenizer, Rust and
    # transformers decode; host work per step with the null model at 1, 64 and 256 running requests;
    # decode attention on bf16, int8 and fp8 KV caches, and int8 against bf16 interleaved; the sampler's
    # picks and draws (torch's and the C++ kernel's, at their shapes); one step's outputs on the engine
    # process's pipe, old records and the wire form, at two prompt lengths; the attention, GEMV, oneDNN
    # linear and quantized GEMV (int8, int4) ops' calls, through the dispatcher, their Python
    # implementations and their kernels alone; the openai client's cost per request, four prompt forms; a
    # verification step's attention, its rows in one walk against one walk each; the decode workload with
    # step plans and without, interleaved, and in multi-step runs and single steps, interleaved. Where
    # the GEMV has its AMX tile path: the dot path at 5 row counts and the tiles at 3, for 3 weight
    # shapes, and the tiles against oneDNN at 7 row counts (31);
    # where the quantized kernel's tile path and oneDNN's bf16 GEMM run, the quantized linears at 64 rows
    # (2); where oneDNN cannot run bf16, torch's bf16 GEMM against the widened one at 3 row counts, the
    # quantized ops' prompt rows, int8 and int4, and their 16- and 64-row decode linears against bf16's
    # forms (9; the last four were not counted before).
    tiles = cpu_gemv.gemv_isa() >= cpu_gemv.ISA_AMX_TILES
    quantized_tiles = cpu_gemv_quantized.tiles_available() and onednn_linear_available(torch.bfloat16)
    widened = not onednn_linear_available(torch.bfloat16)
    expected = 59 + (31 if tiles else 0) + (2 if quantized_tiles else 0) + (9 if widened else 0)
    assert f"{expected} passed" in stdout, stdout[-2000:]


@pytest.mark.slow
def test_embedding_bench_runs_at_smoke_size(tmp_path):
    stdout = _run_bench_smoke(tmp_path, *EMBEDDING_SUITES)
    # One input count at smoke size (the second is skipped), ours against sentence-transformers.
    assert "1 passed, 1 skipped" in stdout, stdout[-2000:]


@pytest.mark.slow
def test_process_bench_suites_run_at_smoke_sizes(tmp_path):
    stdout = _run_bench_smoke(tmp_path, *PROCESS_SUITES)
    # Start-up cold and warm for ours and HF, and ours' cold start with the background compile
    # policy; the step timeline, sync and async loop (ours only); the serving suite's burst and
    # steady loads on our eager server (its fresh-cache and vLLM rows skip); structured outputs,
    # none and half JSON; speculative decoding, none, ngram and the shipped draft at 1 request and
    # at a batch, the three interleaved at 1 request and at the batch, and the draft's k sweep
    # interleaved.
    assert "20 passed" in stdout, stdout[-2000:]


@pytest.mark.slow
def test_pipeline_timeline_bench_runs_at_smoke_size(tmp_path):
    stdout = _run_bench_smoke(tmp_path, *PIPELINE_SUITES)
    # bench/test_pipeline_timeline.py's LAYOUTS, ours only, bench-small: one process; two stages
    # one step at a time, with two micro-batches in a step, with two steps in flight, and with the
    # defaults.
    assert "5 passed" in stdout, stdout[-2000:]


@pytest.mark.slow
def test_compile_policy_bench_suites_run_at_smoke_sizes(tmp_path):
    stdout = _run_bench_smoke(tmp_path, *COMPILE_POLICY_SUITES)
    # A cold-cache server per compile policy (background, blocking); decode beside an idle machine
    # and beside a background compile.
    assert "4 passed" in stdout, stdout[-2000:]


def test_mixed_requests_are_seeded_and_fit_the_context():
    a = mixed_requests(50, (16, 512), (16, 256), 4000, max_model_len=600, seed=7)
    b = mixed_requests(50, (16, 512), (16, 256), 4000, max_model_len=600, seed=7)
    assert a == b
    assert all(len(r.prompt_token_ids) + r.output_len <= 600 for r in a)
    assert all(16 <= r.output_len <= 256 and len(r.prompt_token_ids) >= 1 for r in a)
    assert all(3 <= t < 4000 for r in a for t in r.prompt_token_ids)
    assert [len(batch) for batch in hf_batches(a, 16)] == [16, 16, 16, 2]


def test_bad_profile_and_ranges_are_rejected():
    with pytest.raises(ValueError, match="profile"):
        sizes_for("huge")
    with pytest.raises(ValueError, match="max_model_len"):
        mixed_requests(1, (16, 32), (16, 600), 100, max_model_len=512, seed=0)


def _write_tiny_safetensors(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {
        "model.embed_tokens.weight": torch.zeros(10, 4),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4),
        "model.layers.0.input_layernorm.weight": torch.zeros(4),
        "lm_head.weight": torch.zeros(10, 4),
    }
    save_file(tensors, str(path / "model.safetensors"))
    config = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 4}
    (path / "config.json").write_text(json.dumps(config))


def test_floors_follow_the_byte_and_flop_counts(tmp_path):
    _write_tiny_safetensors(tmp_path)
    rates = HardwareRates(memory_read_gb_s=1e-6, gemm_fp32_gflop_s=1e-6, threads=1)  # 1 kB/s, 1 kFLOP/s
    floors = model_floors(tmp_path, rates, batch=3, context=5)
    # Read per token: q_proj 64 B + norm 16 B + lm_head 160 B (the untied embedding is a lookup).
    assert floors["weight_bytes_read_per_step"] == 240
    assert floors["matmul_params"] == 16 + 40
    kv_per_seq = 2 * 1 * 1 * 2 * 5 * 4  # K and V, 1 layer, 1 kv head, head_dim 2, 5 tokens, fp32
    assert floors["batch1_decode_floor_ms_per_token"] == pytest.approx((240 + kv_per_seq) / 1e3 * 1e3)
    flops_per_token = 2 * 56 + 2 * 2 * 1 * 2 * 2 * 5
    assert floors["batch_compute_floor_ms_per_step"] == pytest.approx(3 * flops_per_token / 1e3 * 1e3)
    assert floors["batch_decode_floor_ms_per_step"] == max(
        floors["batch_compute_floor_ms_per_step"], floors["batch_memory_floor_ms_per_step"]
    )


def _bench(workload, system, param, data, **info):
    stats = {"data": data, "median": sorted(data)[len(data) // 2]}
    extra = {"workload": workload, "model": "m", "system": system, "param": param, **info}
    return {"name": f"{workload}-{system}-{param}", "stats": stats, "extra_info": extra}


def test_report_tables_ratios_and_kept_reading(tmp_path):
    sizes = sizes_for("smoke").__dict__
    results = {
        "compiled_engine_bench": {
            "profile": "smoke",
            "sizes": sizes,
            "command": "python -m pytest bench --bench-size smoke",
            "session_wall_s": 60.0,
            "machine": {"cpu_model": "Test CPU", "usable_cpus": 2, "logical_cpus": 2, "torch_threads": 2,
                        "platform": "x", "python": "3", "torch": "t", "transformers": "tf"},
            "rates": {"memory_read_gb_s": 20.0, "gemm_fp32_gflop_s": 100.0, "threads": 2},
            "floors": {},
        },
        "benchmarks": [
            _bench("ttft", "ours", 16, [0.010, 0.020, 0.030], tokens_generated=1),
            _bench("ttft", "hf", 16, [0.040, 0.040, 0.040], tokens_generated=1),
            _bench("decode", "ours", 4, [1.0], tokens_generated=8, round_tpot_s=[0.1], tpot_median_s=0.1),
            _bench("decode", "hf", 4, [1.0], tokens_generated=8, round_tpot_s=[0.05], tpot_median_s=0.05),
            _bench("throughput", "ours", 5, [2.0], tokens_generated=100, prompt_tokens=50),
            _bench("throughput", "hf", 5, [4.0], tokens_generated=100, prompt_tokens=50),
            _bench("step-timeline", "ours-async", 2, [1.0], tokens_generated=8, round_tokens_per_s=[8.0],
                   timelines=[{"steps": 4, "schedule_s": 1e-4, "prepare_s": 2e-4, "update_s": 1e-4,
                               "execute_s": 0.02, "wait_s": 0.019, "step_wall_s": 0.025,
                               "device_idle": 0.2, "discarded_tokens": 1}]),
        ],
    }  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    out = report.write_report(path, tmp_path / "docs", plots=False)
    text = out.read_text()
    assert "| 16 | 20.0 (±10.0) | 40.0 (±0.0) | 0.50× |" in text  # TTFT ms, IQR of 10/20/30 ms
    assert "| 4 | 100.00 (±0.00) | 50.00 (±0.00) | 2.00× | 40 | 80 |" in text  # TPOT and decode tok/s
    assert "| 5 | 50 | 100 | 50 | 25 | 2.00× |" in text  # tokens/s, ours twice HF
    assert "python -m pytest bench --bench-size smoke" in text and "Test CPU" in text
    assert "| 2 | async | 4 | 0.40 | 20.00 | 19.00 | 25.00 | 20% | 8 | 1 |" in text  # the step timeline

    # A hand-written reading survives regeneration.
    out.write_text(text.replace("(No reading written yet for this run.)", "Attention dominates."))
    report.write_report(path, tmp_path / "docs", plots=False)
    assert "Attention dominates." in out.read_text()


def test_report_rejects_a_json_not_from_the_bench_suites(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"benchmarks": []}))
    assert report.main([str(path), "--out-dir", str(tmp_path), "--no-plots"]) == 1
    assert "compiled_engine_bench" in capsys.readouterr().err


def test_step_report_buckets_steps_and_weights_periods_by_decoding_sequences(tmp_path):
    from bench.cold_serving_variants import step_report

    prefix = tmp_path / "steps"
    # (started, ended, tokens, sequences, with a prompt chunk, outputs); an empty step is left out.
    engine = [
        (0.000, 0.002, 1, 1, 0, 1),
        (0.002, 0.004, 1, 1, 0, 1),
        (0.004, 0.010, 17, 2, 1, 1),  # 6 ms: one decoding sequence waits it
        (0.010, 0.012, 2, 2, 0, 2),  # 2 ms, two decoding sequences
        (0.012, 0.012, 0, 0, 0, 0),
    ]
    (tmp_path / "steps.1.json").write_text(json.dumps(engine))
    (tmp_path / "steps.2.json").write_text(json.dumps(engine[:1]))  # the compiler's: shorter
    report = step_report(prefix)
    assert report["num_steps"] == 4
    rows = {(r["bucket"], r["prompt_chunk"]): r["steps"] for r in report["step_costs"]}
    assert rows == {(1, False): 2, (2, False): 1, (24, True): 1}
    # Periods: 2 ms (1 seq), 6 ms (1 seq), 2 ms (2 seqs) -> [2, 2, 2, 6]: p50 2 ms, p99 6 ms.
    assert abs(report["engine_itl"]["p50_s"] - 0.002) < 1e-9
    assert abs(report["engine_itl"]["p99_s"] - 0.006) < 1e-9


def test_step_profile_puts_plan_calls_in_their_groups_and_the_rest_outside():
    from bench.step_profile import PLAN_GROUPS, plan_call_groups

    calls = [
        ("compiled_engine::cpu_gemv", 0.008),
        ("aten::mm", 0.002),
        ("compiled_engine::paged_attention_cpu", 0.001),
        ("cpp_fused_add_mean_mul_pow_rsqrt_0", 0.0005),
        ("cpp_fused_amax_div_exp_sum_1", 0.0005),  # Inductor's softmax: attention maths
    ]
    groups = plan_call_groups(calls, steps=4, wall_s=0.016)
    assert tuple(groups) == PLAN_GROUPS
    assert groups["linears"] == pytest.approx(2.5)  # (8 + 2) ms over 4 steps
    assert groups["attention"] == pytest.approx(0.375)
    assert groups["other graph kernels"] == pytest.approx(0.125)
    assert groups["outside the plan's calls"] == pytest.approx(4.0 - 3.0)
