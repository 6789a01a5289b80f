"""The "cpu" attention backend: its C++ kernel against the pure-torch reference, its build, and the
engine running on it against Hugging Face's own greedy tokens."""

from __future__ import annotations

import ctypes
import logging
import re
import subprocess
import sys

import pytest
import torch

import compiled_engine.kernels  # noqa: F401  (registers the ops)
from compiled_engine import LLM, SamplingParams
from compiled_engine.kernels import cpu_attention_build
from compiled_engine.kernels.backends import AttentionBackendUnavailableError, resolve_attention_backend
from compiled_engine.kernels.reference import paged_attention_reference
from tests.attention_batches import Batch, check_op_under_torch_compile, fuse_qkv, make_attention_batch
from tests.hf_greedy import MAX_TOKENS, PROMPTS, hf_greedy_tokens

if cpu_attention_build.compiler() is None:
    pytest.skip("no C++ compiler on this machine: the cpu backend cannot be built", allow_module_level=True)

TOLERANCES = {
    torch.float32: dict(atol=2e-6, rtol=2e-5),
    # Both sides compute in float32 and round once to the output dtype; the orders of summation
    # differ, so an element can land one unit of the last place apart.
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]


def check_against_reference(batch: Batch, scale: float, sliding_window: int = -1, softcap: float = 0.0):
    """Both ops from identical caches: outputs close, real cache blocks equal bit for bit."""
    kernel_cache, reference_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    out = torch.ops.compiled_engine.paged_attention_cpu(
        *batch.args(kernel_cache), scale, sliding_window, softcap
    )
    expected = paged_attention_reference(*batch.args(reference_cache), scale, sliding_window, softcap)
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out, expected, **TOLERANCES[batch.query.dtype])
    assert not out.isnan().any(), "NaN in never-written cache slots reached an output"
    if batch.num_pad_rows:
        padding = out[out.shape[0] - batch.num_pad_rows :]
        assert torch.equal(padding, torch.zeros_like(padding)), "padding rows must come back as zeros"
    # The scratch block (last) takes every padding row; with several, which one lands last is free.
    compared = slice(None) if batch.num_pad_rows <= 1 else slice(0, -1)
    torch.testing.assert_close(
        kernel_cache[:, compared], reference_cache[:, compared], atol=0, rtol=0, equal_nan=True
    )
    return out


CASES = {
    "decode_gqa_d64_bs16": ([(37, 1), (130, 1), (0, 1), (15, 1)], dict(head_dim=64, block_size=16), {}),
    "prefill_gqa_d64_bs16": ([(0, 9), (0, 40), (0, 1)], dict(head_dim=64, block_size=16), {}),
    "mixed_mqa_window_padding_d32_bs8": (
        [(5, 6), (20, 1), (0, 5), (9, 0), (0, 0)],
        dict(num_kv_heads=1, head_dim=32, block_size=8, num_pad_rows=3),
        dict(sliding_window=6),
    ),
    "extend_softcap_d48_bs5": (
        [(10, 7), (3, 1), (17, 4)],
        dict(head_dim=48, block_size=5),
        dict(softcap=0.5),
    ),
    "one_padding_row_d16_bs4": ([(6, 3), (2, 1)], dict(num_pad_rows=1), {}),
    "window_and_softcap_d128_g8": (
        [(0, 70), (12, 5), (200, 1)],
        dict(num_q_heads=16, num_kv_heads=2, head_dim=128, block_size=16),
        dict(sliding_window=24, softcap=2.0),
    ),
    # A row whose window is empty of everything but itself, and one head dim the kernel does not
    # specialise (the generic path).
    "window_one_d80": ([(30, 2), (3, 3)], dict(head_dim=80, block_size=16), dict(sliding_window=1)),
    # Verification steps (k + 1 rows after a cached context), which the kernel attends in one walk
    # over each sequence's keys (attend_rows), the later rows masked past their positions.
    "verify_rows_d64_bs16": ([(37, 5), (130, 5), (0, 1), (61, 3)], dict(head_dim=64, block_size=16), {}),
    # 16 rows of one walk (MHA: one query head a KV head) with a 3-key window and blocks of 2: a
    # softmax span holds 8 keys, so the walk's later rows see none of its first span.
    "window_past_a_span_mha_d64_bs2": (
        [(0, 40), (30, 17)],
        dict(num_q_heads=2, num_kv_heads=2, head_dim=64, block_size=2),
        dict(sliding_window=3),
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype):
    spans, batch_options, attention_options = CASES[case]
    batch = make_attention_batch(spans, dtype=dtype, **batch_options)
    check_against_reference(batch, batch.query.shape[2] ** -0.5, **attention_options)


def test_random_context_lengths_one_thread_and_many():
    gen = torch.Generator().manual_seed(3)
    spans = [
        (int(torch.randint(0, 90, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen)))
        for _ in range(9)
    ]
    batch = make_attention_batch(spans, head_dim=64, block_size=16, num_pad_rows=2, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = check_against_reference(batch, 0.125)
    finally:
        torch.set_num_threads(threads)
    many = check_against_reference(batch, 0.125)
    assert torch.equal(one, many), "the split of work over threads must not change a result"


def test_strided_keys_int64_tables_and_a_strided_query():
    # As the model hands them over: k and v are views into one fused projection's output.
    batch = make_attention_batch([(12, 4), (3, 2)], head_dim=32, block_size=4)
    fuse_qkv(batch)
    assert not batch.key.is_contiguous()
    batch.block_tables = batch.block_tables.long()
    batch.seq_lens, batch.query_start_loc = batch.seq_lens.long(), batch.query_start_loc.long()
    check_against_reference(batch, 0.2, sliding_window=5)


def test_query_dtype_must_match_the_cache():
    batch = make_attention_batch([(5, 4)], dtype=torch.float32)
    with pytest.raises(ValueError, match="one dtype"):
        torch.ops.compiled_engine.paged_attention_cpu(*batch.args(batch.kv_cache.half()), 0.25)


def test_a_slot_past_the_cache_is_refused_and_nothing_is_written():
    batch = make_attention_batch([(5, 3)], dtype=torch.float32)
    num_slots = batch.kv_cache.shape[1] * batch.kv_cache.shape[2]
    batch.slot_mapping = batch.slot_mapping.clone()
    batch.slot_mapping[1] = num_slots
    cache = batch.kv_cache.clone()
    with pytest.raises(IndexError, match="past the cache"):
        torch.ops.compiled_engine.paged_attention_cpu(*batch.args(cache), 0.25)
    torch.testing.assert_close(cache, batch.kv_cache, atol=0, rtol=0, equal_nan=True)


def test_op_under_torch_compile_writes_the_real_cache():
    check_op_under_torch_compile(torch.ops.compiled_engine.paged_attention_cpu, atol=0.0)


def test_auto_picks_cpu_on_the_cpu_and_falls_back_without_a_compiler(monkeypatch, tmp_path, caplog):
    assert resolve_attention_backend("auto", "cpu").name == "cpu"
    backend = resolve_attention_backend("cpu", "cpu")
    assert backend.op is torch.ops.compiled_engine.paged_attention_cpu
    # Its version is a hash of its sources (kernels/source_version.py), not the reference's.
    assert re.fullmatch(r"[0-9a-f]{16}", backend.version)
    assert backend.version != resolve_attention_backend("torch", "cpu").version

    monkeypatch.setattr(cpu_attention_build, "_loaded", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with caplog.at_level(logging.WARNING, logger="compiled_engine.kernels.backends"):
        assert resolve_attention_backend("auto", "cpu").name == "torch"
    assert "no C++ compiler" in caplog.text, "falling back must say why"
    with pytest.raises(AttentionBackendUnavailableError, match="no C\\+\\+ compiler"):
        resolve_attention_backend("cpu", "cpu")
    with pytest.raises(AttentionBackendUnavailableError, match="runs on the CPU"):
        resolve_attention_backend("cpu", "meta")


def test_a_failing_build_names_the_compiler_error(tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(cpu_attention_build.CpuKernelBuildError, match="failed on broken.cpp"):
        cpu_attention_build.build(tmp_path / "out", source_file=broken)
    assert not any((tmp_path / "out").iterdir()), "a failed build must leave no file behind"


@pytest.mark.slow  # two full kernel builds (~18 s): the default run's budget
def test_a_damaged_library_is_rebuilt_with_a_warning(monkeypatch, tmp_path, caplog):
    good = cpu_attention_build.build(tmp_path)
    good.write_bytes(b"not a shared library")  # as a failed disk would leave it
    monkeypatch.setattr(cpu_attention_build, "_loaded", None)
    with caplog.at_level(logging.WARNING, logger="compiled_engine.kernels.cpu_attention_build"):
        library = cpu_attention_build.load(tmp_path)
    assert "rebuilding" in caplog.text
    assert good.stat().st_size > 1000 and library.ce_cpu_paged_attention is not None


def test_a_local_header_is_part_of_the_librarys_key(tmp_path):
    """A source's headers from its own folder (kernels/cpu_amx.h for the GEMVs) key its library
    with it: an edited header builds a new library rather than loading the stale one."""
    header = tmp_path / "shared.h"
    header.write_text("inline int ce_value() { return 1; }\n")
    source = tmp_path / "probe.cpp"
    source.write_text('#include "shared.h"\nextern "C" int ce_probe() { return ce_value(); }\n')
    assert cpu_attention_build.local_headers(source) == [header]
    first = cpu_attention_build.build(tmp_path / "out", source_file=source)
    assert ctypes.CDLL(str(first)).ce_probe() == 1
    header.write_text("inline int ce_value() { return 2; }\n")
    second = cpu_attention_build.build(tmp_path / "out", source_file=source)
    assert second != first and ctypes.CDLL(str(second)).ce_probe() == 2


def test_an_unwritable_build_dir_is_a_build_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(cpu_attention_build.CpuKernelBuildError, match="cannot write"):
        cpu_attention_build.build(blocker / "sub")


_BUILD = """
import sys
from pathlib import Path
from compiled_engine.kernels import cpu_attention_build
print(cpu_attention_build.build(Path(sys.argv[1])))
"""


def test_two_processes_building_at_once_both_get_one_library(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1]
    assert [p.name for p in tmp_path.iterdir()] == [outputs[0].rsplit("/", 1)[1]], "no temporary left behind"
    # A later build finds it and does not compile again (the file is untouched).
    built = tmp_path / outputs[0].rsplit("/", 1)[1]
    stamp = built.stat().st_mtime_ns
    assert str(cpu_attention_build.build(tmp_path)) == outputs[0]
    assert built.stat().st_mtime_ns == stamp


@pytest.fixture(scope="module")
def hf_tokens(llama_dir):
    return hf_greedy_tokens(llama_dir)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_engine_on_the_cpu_backend_matches_hf_greedy(llama_dir, hf_tokens, enforce_eager):
    llm = LLM(
        llama_dir,
        dtype="float32",
        attention_backend="cpu",
        enforce_eager=enforce_eager,
        max_model_len=64,
        max_num_seqs=4,
        block_size=4,
        num_kv_blocks=32,
        compile_buckets=(4, 16),
    )
    runner = llm.engine.model_runner
    assert runner.attention_backend.name == "cpu"
    pass_log = runner.step_graph.captured.pass_log if enforce_eager else runner.step_graph.traced.pass_log
    # Every graph's attention calls (2 layers) run the kernel: no bucket keeps the inline maths.
    assert [r.result("select_attention_backend").nodes_rewritten for r in pass_log] == [2] * len(pass_log)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_tokens
    stats = llm.engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "every KV block back in the pool"
