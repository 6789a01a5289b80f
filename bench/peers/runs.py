"""The peers' side of the decode and throughput suites: the same requests, answered as RunResults.

A PeerSession holds what `--peer` named and whether each is installed; the suites ask it for one
workload at a time. vLLM keeps one engine per (model, dtype) alive in a worker process for the whole
bench session (bench/peers/vllm_runner.py), so it starts once, as ours does. llama.cpp runs
llama-batched-bench once per (model, dtype, concurrency) and llama-bench-mixed once per throughput
request set (bench/peers/llamacpp.py).

The peers time their own rounds (in their process, after their warm-up), so a suite records the
peer's round times, not the wall time of the call that fetched them (bench/report.py reads them).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from bench.peers import launch
from bench.peers.llamacpp import MIXED_BINARY, gguf_path, run_batched_bench, run_mixed
from bench.peers.spec import LLAMACPP, VLLM, PeerSpec, missing_reason
from bench.runners import EngineSettings, RunResult
from bench.workloads import BenchRequest

VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")
ANSWER_PREFIX = "@@bench-peer "  # vllm_runner.ANSWER_PREFIX (that file imports nothing of ours)


class PeerUnavailable(Exception):
    """The peer cannot run this workload; the message is what its column says."""


def _request_json(requests: list[BenchRequest]) -> list[dict]:
    return [{"prompt_token_ids": list(r.prompt_token_ids), "output_len": r.output_len} for r in requests]


class VllmWorker:
    """One vLLM engine in its own venv's interpreter, fed cases over a pipe."""

    def __init__(
        self, python: Path, model_dir: Path, dtype: str, settings: EngineSettings, warm: list[BenchRequest]
    ):
        self.key = (str(model_dir), dtype)
        self.log = tempfile.NamedTemporaryFile(prefix="bench-vllm-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(python), str(VLLM_RUNNER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=launch.vllm_env(python),
            # Not the checkout: vLLM's helper processes run `python -m` from the working folder, and
            # this repository's top-level packages (kernels/ among them) would shadow its imports.
            cwd=tempfile.gettempdir(),
            # Its own process group: vLLM's engine-core and worker processes go with it on close,
            # never left running (and taking cores) beside the next system's timed rounds.
            start_new_session=True,
        )
        job = {
            "model_dir": str(model_dir),
            "dtype": dtype,
            "max_model_len": settings.max_model_len,
            "max_num_seqs": settings.max_num_seqs,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "warm_requests": _request_json(warm),
        }
        self.version = self._ask(job)["version"]

    def _ask(self, payload: dict) -> dict:
        """Send one line, read up to the answer line (vLLM's own log lines pass by)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(payload) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(ANSWER_PREFIX):
                return json.loads(line[len(ANSWER_PREFIX) :])
        self.proc.wait()
        raise RuntimeError(
            f"vLLM worker exited ({self.proc.returncode}); its log: {self.log.name}\n{self.log_tail()}"
        )

    def log_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def run(
        self, workload: str, key: str, requests: list[BenchRequest], rounds: int, warmup: int
    ) -> list[dict]:
        case = {
            "workload": workload,
            "key": key,
            "requests": _request_json(requests),
            "rounds": rounds,
            "warmup_rounds": warmup,
        }
        return self._ask(case)["rounds"]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the whole group: engine core and workers too
        self.proc.wait()
        self.log.close()


class PeerSession:
    """The peers of one bench session: their status, the vLLM worker, the GGUF files."""

    def __init__(self, peers: dict[str, PeerSpec], quantization: str | None = None):
        """`quantization`: --bench-quantization; llama.cpp then runs its Q8_0 / Q4_0 of the weights."""
        self.peers = peers
        self.quantization = quantization
        self.status = {name: missing_reason(spec) or "installed" for name, spec in peers.items()}
        self.versions: dict[str, str] = {}
        self._vllm: VllmWorker | None = None

    def names(self) -> list[str]:
        return list(self.peers)

    def describe(self) -> dict:
        """For the results JSON: each peer's path, status and (once run) version."""
        return {
            name: {"path": str(spec.path), "status": self.status[name], "version": self.versions.get(name)}
            for name, spec in self.peers.items()
        }

    def _check(self, peer: str) -> PeerSpec:
        if self.status[peer] != "installed":
            raise PeerUnavailable(f"{peer}: {self.status[peer]}")
        return self.peers[peer]

    def decode(self, peer, model_dir, dtype, settings, warm, requests, rounds, warmup) -> list[RunResult]:
        """Requests of one prompt and output length, decoding together (bench/test_decode.py)."""
        spec = self._check(peer)
        output_len = requests[0].output_len
        if peer == LLAMACPP:
            prompt_len = len(requests[0].prompt_token_ids)
            gguf = gguf_path(spec, model_dir, dtype, self.quantization)
            self.versions[LLAMACPP] = "llama-cpp-python 0.3.36 vendored llama.cpp"
            found = run_batched_bench(
                spec, gguf, prompt_len, output_len - 1, len(requests), warmup + rounds, launch.bench_threads()
            )
            tokens = len(requests) * output_len
            return [
                RunResult(r.prefill_s + r.decode_s, tokens, r.decode_s, r.decode_steps)
                for r in found[warmup:]
            ]
        worker = self._vllm_worker(spec, model_dir, dtype, settings, warm)
        found_rounds = worker.run("decode", f"decode-{len(requests)}", requests, rounds, warmup)
        return [
            RunResult(r["elapsed_s"], r["tokens_generated"], r["decode_s"], output_len - 1)
            for r in found_rounds
        ]

    def throughput(self, peer, model_dir, dtype, settings, warm, requests, rounds) -> list[RunResult]:
        """Requests of mixed lengths, all handed over at once (bench/test_throughput.py)."""
        spec = self._check(peer)
        if peer == LLAMACPP:
            if not (spec.path / MIXED_BINARY).exists():
                raise PeerUnavailable(
                    f"llamacpp: {spec.path / MIXED_BINARY} missing (scripts/peers/llamacpp_build.sh)"
                )
            gguf = gguf_path(spec, model_dir, dtype, self.quantization)
            found = run_mixed(spec, gguf, requests, settings, rounds, launch.bench_threads())
            return [RunResult(r.elapsed_s, r.tokens_generated) for r in found]
        worker = self._vllm_worker(spec, model_dir, dtype, settings, warm)
        found_rounds = worker.run("throughput", f"throughput-{len(requests)}", requests, rounds, 0)
        return [RunResult(r["elapsed_s"], r["tokens_generated"]) for r in found_rounds]

    def _vllm_worker(self, spec, model_dir, dtype, settings, warm) -> VllmWorker:
        assert spec.name == VLLM
        if self.quantization is not None:
            raise PeerUnavailable(
                f"vllm: not run with --bench-quantization {self.quantization} (no CPU path here)"
            )
        if self._vllm is not None and self._vllm.key != (str(model_dir), dtype):
            self._vllm.close()
            self._vllm = None
        if self._vllm is None:
            self._vllm = VllmWorker(spec.path, model_dir, dtype, settings, warm)
            self.versions[VLLM] = f"vllm {self._vllm.version}"
        return self._vllm

    def close(self) -> None:
        if self._vllm is not None:
            self._vllm.close()
            self._vllm = None
