"""`--peer` plumbing of the bench suites: parsing, "not installed" columns, clear errors.

No peer is installed in CI: these tests check what happens without one (and with bad values);
the peers themselves are timed by `pytest bench/ --peer ...` (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from bench.peers.llamacpp import batched_bench_argv, mixed_argv, parse_jsonl
from bench.peers.spec import PeerSpec, missing_reason, parse_peer, parse_peers
from bench.runners import EngineSettings, RunResult
from bench.test_decode_interleaved import interleaved_summary
from bench.workloads import sizes_for

REPO = Path(__file__).resolve().parents[1]


def test_peer_values_parse_to_name_and_path():
    assert parse_peer("vllm=/opt/v/bin/python") == PeerSpec("vllm", Path("/opt/v/bin/python"))
    assert parse_peers(["llamacpp=/opt/l", "vllm=/p"]) == {
        "llamacpp": PeerSpec("llamacpp", Path("/opt/l")),
        "vllm": PeerSpec("vllm", Path("/p")),
    }
    assert parse_peers(None) == {}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("vllm", "has no '='"),
        ("tgi=/x", "unknown peer 'tgi'"),
        ("vllm=", "empty PATH"),
        ("llamacpp=  ", "empty PATH"),
    ],
)
def test_bad_peer_values_say_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        parse_peer(value)


def test_a_peer_named_twice_is_an_error():
    with pytest.raises(ValueError, match="given twice"):
        parse_peers(["vllm=/a", "vllm=/b"])


def test_missing_installs_are_reported_not_raised(tmp_path):
    assert missing_reason(PeerSpec("vllm", tmp_path / "nope" / "python")).startswith("not installed: ")
    # A real interpreter without vllm: this test's own.
    assert "has no vllm package" in missing_reason(PeerSpec("vllm", Path(sys.executable)))
    assert "is not a folder" in missing_reason(PeerSpec("llamacpp", tmp_path / "nope"))
    assert "llama-batched-bench is missing" in missing_reason(PeerSpec("llamacpp", tmp_path))


def test_batched_bench_runs_the_decode_workloads_steps_and_parses_its_lines(tmp_path):
    argv = batched_bench_argv(PeerSpec("llamacpp", tmp_path), tmp_path / "m.gguf", 64, 63, 16, 3, 2)
    # 16 sequences x (64 + 63) cells, rounded up to 256; one -npl entry per round.
    assert argv[argv.index("-c") + 1] == "2048"
    assert argv[argv.index("-npl") + 1] == "16,16,16"
    assert argv[argv.index("-ntg") + 1] == "63" and argv[argv.index("-t") + 1] == "2"
    line = ('{"n_kv_max": 2048, "pp": 64, "tg": 63, "pl": 16, "n_kv": 2032, "t_pp": 0.5, '
            '"speed_pp": 2048.0, "t_tg": 1.5, "speed_tg": 672.0, "t": 2.0, "speed": 1016.0}')  # fmt: skip
    (found,) = parse_jsonl(f"main: loading\n{line}\n\nllama_perf_context_print: ...")
    assert (found.sequences, found.prompt_len, found.decode_steps) == (16, 64, 63)
    assert (found.prefill_s, found.decode_s) == (0.5, 1.5)


def test_the_mixed_length_driver_gets_our_engine_limits(tmp_path):
    settings = EngineSettings(
        max_model_len=768, max_num_seqs=300, max_num_batched_tokens=2048, num_kv_blocks=1
    )
    argv = mixed_argv(PeerSpec("llamacpp", tmp_path), tmp_path / "m.gguf", tmp_path / "r.txt", settings, 1, 2)
    # THREADS MAX_MODEL_LEN MAX_SEQS (capped at llama.cpp's 256) TOKEN_BUDGET ROUNDS
    assert argv[3:] == ["2", "768", "256", "2048", "1"]


def _run_pytest(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COMPILED_ENGINE_BENCH_CACHE=str(tmp_path / "cache"), TQDM_DISABLE="1")
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-q", "--benchmark-disable", "--bench-size", "smoke",
         "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_bench_suites_skip_a_peer_that_is_not_installed(tmp_path):
    """The peers' tests exist beside ours and HF's, and skip (no crash) where nothing is installed."""
    no_venv, no_dir = tmp_path / "no-venv" / "bin" / "python", tmp_path / "no-dir"
    proc = _run_pytest(
        tmp_path, "bench/test_decode.py", "bench/test_decode_interleaved.py", "bench/test_throughput.py",
        "-k", "vllm or llamacpp", "-rs", "--peer", f"vllm={no_venv}", "--peer", f"llamacpp={no_dir}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # decode, decode interleaved and throughput: one row per peer each at smoke size.
    assert "6 skipped" in proc.stdout, proc.stdout[-3000:]
    assert "vllm: not installed" in proc.stdout and "llamacpp: not installed" in proc.stdout


def test_interleaved_summary_pairs_the_rounds_in_order():
    # Per pair: ours' and the peer's TPOT (decode_s / steps) and end-to-end time.
    ours = [RunResult(0.30, 64, 0.126, 63), RunResult(0.20, 64, 0.063, 63), RunResult(0.25, 64, 0.189, 63)]
    peer = [RunResult(0.40, 64, 0.189, 63), RunResult(0.10, 64, 0.126, 63), RunResult(0.50, 64, 0.252, 63)]
    summary = interleaved_summary(ours, peer)
    assert summary["ours_round_tpot_s"] == pytest.approx([0.002, 0.001, 0.003])
    assert summary["peer_round_tpot_s"] == pytest.approx([0.003, 0.002, 0.004])
    assert summary["tpot_ratio"] == pytest.approx(0.002 / 0.003)
    assert summary["elapsed_ratio"] == pytest.approx(0.25 / 0.40)
    assert summary["ours_faster_pairs"] == 3
    # A pair whose peer was faster is not counted.
    peer[1] = RunResult(0.10, 64, 0.0315, 63)
    assert interleaved_summary(ours, peer)["ours_faster_pairs"] == 2
    with pytest.raises(ValueError, match="no TPOT"):
        interleaved_summary([RunResult(0.3, 64)], [RunResult(0.4, 64, 0.1, 63)])
    with pytest.raises(ValueError):  # the pairs must match one to one
        interleaved_summary(ours, peer[:2])


def test_a_bad_peer_value_stops_the_bench_session_with_its_reason(tmp_path):
    proc = _run_pytest(tmp_path, "bench/test_decode.py", "--collect-only", "--peer", "vllm")
    assert proc.returncode != 0
    assert "has no '='" in proc.stdout + proc.stderr


def _bench(workload, system, param, data, **info):
    stats = {"data": data, "median": sorted(data)[len(data) // 2]}
    extra = {"workload": workload, "model": "m", "system": system, "param": param, **info}
    return {"name": f"{workload}-{system}-{param}", "stats": stats, "extra_info": extra}


def test_report_puts_peer_columns_beside_ours_and_hf(tmp_path):
    context = {
        "profile": "smoke",
        "dtype": "bfloat16",
        "sizes": sizes_for("smoke").__dict__,
        "command": "python -m pytest bench --peer vllm=/v/bin/python --peer llamacpp=/nope",
        "session_wall_s": 60.0,
        "machine": {"cpu_model": "Test CPU", "usable_cpus": 2, "logical_cpus": 2, "torch_threads": 2,
                    "platform": "x", "python": "3", "torch": "t", "transformers": "tf"},
        "rates": {"memory_read_gb_s": 20.0, "gemm_fp32_gflop_s": 100.0, "threads": 2},
        "floors": {},
        "peers": {"vllm": {"path": "/v/bin/python", "status": "installed", "version": "vllm 0.32.0"},
                  "llamacpp": {"path": "/nope", "status": "not installed: /nope is not a folder"}},
    }  # fmt: skip

    def decode(system, seconds, tpot, **info):
        return _bench("decode", system, 2, [seconds], tokens_generated=8, round_tpot_s=[tpot],
                      tpot_median_s=tpot, **info)  # fmt: skip

    peer = {"timed_in": "peer"}
    results = {
        "compiled_engine_bench": context,
        "benchmarks": [
            decode("ours", 1.0, 0.1),
            decode("hf", 2.0, 0.2),
            # The peer's own round times (4 s) count, not the wall time of the call that fetched them (99 s).
            decode("vllm", 99.0, 0.4, round_elapsed_s=[4.0, 4.0], **peer),
            _bench("throughput", "ours", 5, [2.0], tokens_generated=100, prompt_tokens=50),
            _bench("throughput", "vllm", 5, [99.0], tokens_generated=100, prompt_tokens=50,
                   round_elapsed_s=[5.0], **peer),
        ],
    }  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    text = report.write_report(path, tmp_path / "docs", plots=False).read_text()
    # Decode: vLLM TPOT and tok/s, llama.cpp not installed.
    assert "| vLLM TPOT | vLLM decode tok/s | llama.cpp TPOT | llama.cpp decode tok/s |" in text
    assert "| 400.00 (±0.00) | 5 | not installed | not installed |" in text
    # Beside the peers: e2e (decode) tok/s, ratios on e2e: ours 8/1 s, vLLM 8/4 s, HF 8/2 s.
    assert "| m bf16, 2 | 8 (20) | 2 (5) | not installed | 4 (10) | 4.00× | — | 2.00× |" in text
    # Throughput: vLLM 100 tokens / 5 s, ours 50 tok/s: 2.5x.
    assert "| 20 | 2.50× | not installed | not installed |" in text
    assert report.main(["--peers-table", str(path), str(path)]) == 0


def test_the_peers_table_names_a_quantized_sessions_weights():
    # --bench-quantization int4: ours ran int4 weights and llama.cpp its Q4_0, so the row says int4,
    # not only the activations' dtype.
    context = {"dtype": "bfloat16", "quantization": "int4", "peers": {"llamacpp": {"status": "installed"}}}
    decode = [
        _bench("decode", "ours", 1, [2.0], tokens_generated=64, round_tpot_s=[0.02], tpot_median_s=0.02),
        _bench("decode", "llamacpp", 1, [4.0], tokens_generated=64, round_tpot_s=[0.05], tpot_median_s=0.05,
               timed_in="peer", round_elapsed_s=[4.0]),
    ]  # fmt: skip
    results = {(b["extra_info"]["workload"], b["extra_info"]["model"], b["extra_info"]["param"],
                b["extra_info"]["system"]): b for b in decode}  # fmt: skip
    lines = report.peers_section([(context, results)])
    assert "| m bf16 int4, 1 | 32 (50) | 16 (20) | — | 2.00× | — |" in lines
    unquantized = report.peers_section([({**context, "quantization": None}, results)])
    assert "| m bf16, 1 | 32 (50) | 16 (20) | — | 2.00× | — |" in unquantized
