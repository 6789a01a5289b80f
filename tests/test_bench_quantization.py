"""`--bench-quantization`: our engine quantized in the bench, llama.cpp's Q8_0 / Q4_0 of the same
weights as its peer, and clear errors where a piece is missing (no peer is installed in CI)."""

from __future__ import annotations

import pytest

from bench.peers.llamacpp import GGUF_QUANTIZED_TYPES, gguf_path
from bench.peers.runs import PeerSession, PeerUnavailable
from bench.peers.spec import PeerSpec
from compiled_engine.engine_args import QUANTIZATION_CHOICES
from tests.test_bench_peers import _run_pytest


def test_every_scheme_has_a_llamacpp_counterpart():
    assert set(GGUF_QUANTIZED_TYPES) == set(QUANTIZATION_CHOICES)


def test_q4_0_needs_llama_quantize_and_says_where_it_comes_from(tmp_path):
    with pytest.raises(RuntimeError, match=r"llama-quantize missing \(scripts/peers/llamacpp_build.sh"):
        gguf_path(PeerSpec("llamacpp", tmp_path), tmp_path / "model", "bfloat16", "int4")


def test_the_vllm_peer_is_skipped_when_quantized(tmp_path):
    session = PeerSession({"vllm": PeerSpec("vllm", tmp_path / "python")}, quantization="int8")
    with pytest.raises(PeerUnavailable, match="not run with --bench-quantization int8"):
        session._vllm_worker(session.peers["vllm"], tmp_path, "float32", None, [])


def test_a_bad_quantization_stops_the_bench_session(tmp_path):
    proc = _run_pytest(tmp_path, "bench/test_decode.py", "--collect-only", "--bench-quantization", "int3")
    assert proc.returncode != 0
    assert "invalid choice: 'int3'" in proc.stdout + proc.stderr


def test_q8_0_comes_from_llama_quantize_too(tmp_path):
    # Both llama.cpp files come from one float GGUF through llama-quantize (its defaults for the
    # output matrix), so a Q8_0 run also needs the tool.
    with pytest.raises(RuntimeError, match=r"llama-quantize missing \(scripts/peers/llamacpp_build.sh"):
        gguf_path(PeerSpec("llamacpp", tmp_path), tmp_path / "model", "bfloat16", "int8")
