"""`compiled-engine warmup`: fills the compile cache, prints its table, and runs safely in parallel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from compiled_engine import LLM, SamplingParams
from compiled_engine.entrypoints.cli import main
from compiled_engine.entrypoints.warmup import linears_label
from compiled_engine.kernels.backends import resolve_attention_backend

OPTIONS = ["--dtype", "float32", "--buckets", "1,2", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
LLM_OPTIONS = dict(dtype="float32", compile_buckets=[1, 2], max_num_seqs=2, max_num_batched_tokens=32)


def _warm_llm(model_dir: str, cache_dir) -> LLM:
    return LLM(model_dir, cache_dir=str(cache_dir), **LLM_OPTIONS)


def test_warmup_prints_a_table_and_a_later_start_is_warm(llama_dir, tmp_path, capsys):
    assert main(["warmup", "--model", llama_dir, "--cache-dir", str(tmp_path), *OPTIONS]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    header = [
        "bucket",
        "cache",
        "linears",
        "attention",
        "passes",
        "compile",
        "s",
        "load",
        "s",
        "saved",
        "weights",
    ]
    assert lines[1].split() == header
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"1", "2", "dynamic"}
    assert all(row[-2] == "yes" and row[-1] == "float32" for row in rows.values())
    # The dynamic graph is never GEMV-lowered. Its attention is the backend's op; decode buckets
    # inline the maths only under the torch backend (auto takes the cpu kernel where it builds).
    assert rows["dynamic"][2] in ("onednn", "torch")
    backend = resolve_attention_backend("auto", "cpu").name
    assert rows["dynamic"][3] == backend
    assert rows["1"][3] == rows["2"][3] == ("inline" if backend == "torch" else backend)

    # The same options in the API start warm: no trace, everything loaded.
    step = _warm_llm(llama_dir, tmp_path).engine.model_runner.step_graph
    assert step.num_traces == 0
    assert {b.source for b in step.builds.values()} == {"loaded"}
    # The table's linears column names the form each saved graph was built with.
    for bucket, label in ((1, "1"), (2, "2"), (None, "dynamic")):
        assert rows[label][2] == linears_label(step.builds[bucket].variant)

    # Run again: every graph is a cache hit, and says which passes its graph got.
    assert main(["warmup", "--model", llama_dir, "--cache-dir", str(tmp_path), *OPTIONS]) == 0
    hits = [line.split() for line in capsys.readouterr().out.strip().splitlines()[2:]]
    assert [row[1] for row in hits] == ["hit", "hit", "hit"]
    assert {row[0]: row[4] for row in hits} == {label: row[4] for label, row in rows.items()}


def test_warmup_bad_option_is_a_clear_error(llama_dir, tmp_path, capsys):
    code = main(["warmup", "--model", llama_dir, "--cache-dir", str(tmp_path), "--buckets", "0"])
    assert code == 2
    assert "bucket" in capsys.readouterr().err


@pytest.mark.slow
def test_two_concurrent_warmups_of_one_key_are_both_fine(llama_dir, tmp_path):
    command = [
        sys.executable, "-m", "compiled_engine.entrypoints.cli", "warmup",
        "--model", llama_dir, "--cache-dir", str(tmp_path), *OPTIONS,
    ]  # fmt: skip
    env = dict(os.environ, TQDM_DISABLE="1")
    procs = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for proc, (_out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err.decode()[-3000:]
        assert b"unusable" not in err  # neither saw the other's half-written files
    entries = list((tmp_path / "entries").iterdir())
    assert len(entries) == 1
    assert not [p for p in entries[0].iterdir() if p.name.startswith(".")]  # no temporary files left
    llm = _warm_llm(llama_dir, tmp_path)
    assert llm.engine.model_runner.step_graph.num_traces == 0
    out = llm.generate(
        [{"prompt_token_ids": [4, 5, 6]}], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3
