"""Decode beside a peer, round by round: ours and the peer alternate in one test (#19).

bench/test_decode.py runs every round of ours, then every round of each peer. On a machine whose
speed drifts between minutes (docs/benchmarks.md, session 26: two runs of the same code at one
request read 1.06x and 0.83x llama.cpp), a ratio near 1 then says as much about when each system
ran as about either. Here a pair is one round of ours and one call of the peer (its
own warm-up round in its own process, then one timed round), ours first in even pairs and the
peer first in odd ones, so both sides see the same stretches of the machine.

    python -m pytest bench/test_decode_interleaved.py -p no:cacheprovider -q -s \
        --bench-model bench-small --bench-dtype bfloat16 --peer llamacpp=/work/peers/llamacpp -k "1]"

Same requests and accounting as bench/test_decode.py (TPOT = decode time after every request has
its first token / decode steps). Reported in extra_info and printed: each side's per-pair TPOT and
end-to-end time, their medians, ours over the peer's (below 1: ours faster), and in how many pairs
ours was faster. Without a `--peer` there is nothing to run: the suite's rows skip.
"""

from __future__ import annotations

import statistics

import pytest

from bench.peers.runs import PeerUnavailable
from bench.runners import RunResult, run_engine_decode

PAIRS = {"full": 9, "quick": 5, "smoke": 1}
PEER_WARMUP_ROUNDS = 1  # per peer call: llama.cpp starts a process (and loads the model) per call


def test_decode_interleaved(benchmark, bench_session, sizes, model_name, system, concurrency):
    if system in ("ours", "hf"):
        pytest.skip("the rows are a --peer's, with ours beside it")
    requests = bench_session.decode_requests(model_name, concurrency)
    llm = bench_session.engine(model_name)
    run_engine_decode(llm, requests)  # warm-up: every decode bucket of this batch compiled and captured
    peer_args = (
        system, bench_session.model_dir(model_name), bench_session.dtype, bench_session.settings(model_name),
        bench_session.warm_requests(model_name), requests,
    )  # fmt: skip
    ours: list[RunResult] = []
    peer: list[RunResult] = []

    def run_ours() -> None:
        ours.append(run_engine_decode(llm, requests))

    def run_peer() -> None:
        (result,) = bench_session.peers.decode(*peer_args, 1, PEER_WARMUP_ROUNDS)
        peer.append(result)

    def one_pair() -> None:
        first, second = (run_ours, run_peer) if len(ours) % 2 == 0 else (run_peer, run_ours)
        first()
        second()

    benchmark.group = f"decode interleaved {model_name} concurrency={concurrency}"
    try:
        benchmark.pedantic(one_pair, rounds=PAIRS[sizes.profile], iterations=1, warmup_rounds=0)
    except PeerUnavailable as exc:
        pytest.skip(str(exc))
    assert len(ours) == len(peer) == PAIRS[sizes.profile]
    expected = concurrency * sizes.decode_output_len
    assert all(r.tokens_generated == expected for r in ours + peer)
    summary = interleaved_summary(ours, peer)
    benchmark.extra_info.update(
        workload="decode-interleaved",
        model=model_name,
        system=system,
        param=concurrency,
        dtype=bench_session.dtype,
        quantization=bench_session.quantization or "none",
        **summary,
    )
    weights = bench_session.dtype if bench_session.quantization is None else bench_session.quantization
    print(
        f"\n{model_name} {weights}, {concurrency} request(s), ours / {system} (interleaved, "
        f"{len(ours)} pairs): TPOT {summary['ours_tpot_median_s'] * 1e3:.3f} / "
        f"{summary['peer_tpot_median_s'] * 1e3:.3f} ms = {summary['tpot_ratio']:.3f}, end to end "
        f"{summary['elapsed_ratio']:.3f}; ours faster in {summary['ours_faster_pairs']} of {len(ours)} "
        "pairs (TPOT)"
    )


def interleaved_summary(ours: list[RunResult], peer: list[RunResult]) -> dict:
    """Per-pair times, medians, ours / the peer's medians, and the pairs whose TPOT ours won."""
    ours_tpot, peer_tpot = _tpots(ours), _tpots(peer)
    ours_elapsed, peer_elapsed = [r.elapsed_s for r in ours], [r.elapsed_s for r in peer]
    return {
        "ours_round_tpot_s": ours_tpot,
        "peer_round_tpot_s": peer_tpot,
        "ours_round_elapsed_s": ours_elapsed,
        "peer_round_elapsed_s": peer_elapsed,
        "ours_tpot_median_s": statistics.median(ours_tpot),
        "peer_tpot_median_s": statistics.median(peer_tpot),
        "tpot_ratio": statistics.median(ours_tpot) / statistics.median(peer_tpot),
        "elapsed_ratio": statistics.median(ours_elapsed) / statistics.median(peer_elapsed),
        "ours_faster_pairs": sum(o < p for o, p in zip(ours_tpot, peer_tpot, strict=True)),
    }


def _tpots(results: list[RunResult]) -> list[float]:
    tpots = [r.tpot_s for r in results]
    if any(t is None for t in tpots):
        raise ValueError("a decode round without a decode window: no TPOT")
    return [t for t in tpots if t is not None]
