"""Peer servers for the serving suite: which peers were asked for, and vLLM's OpenAI server launched
as its CPU guide says.

`--peer vllm=PYTHON` (bench/conftest.py) names the interpreter of a venv holding vLLM's CPU wheel
(built by scripts/peers/vllm_venv.sh). A peer not given, or whose interpreter is missing, is
"not installed".

vLLM on CPU: tcmalloc and the wheel's Intel OpenMP preloaded (LD_PRELOAD), its OpenMP threads bound
to the same number of cores our engine uses, the same model folder and dtype.
"""

from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path

from bench.peers.spec import parse_peers
from bench.serving_harness import ServerProcess, free_port


def requested_peers(config) -> dict[str, str]:
    """NAME -> PATH for every `--peer` given (bench/peers/spec.py parses and checks them)."""
    return {name: str(spec.path) for name, spec in parse_peers(config.getoption("--peer", None)).items()}


def vllm_python(config) -> tuple[str | None, str]:
    """(the vLLM venv's python, "") or (None, why it cannot run)."""
    python = requested_peers(config).get("vllm")
    if python is None:
        return None, "not installed (run with --peer vllm=PYTHON)"
    if not os.access(python, os.X_OK):
        return None, f"not installed ({python} is not an executable)"
    return python, ""


def vllm_preload(python: str) -> str:
    """tcmalloc (the system's) and the wheel's libiomp5.so, as vLLM's CPU guide asks."""
    found = []
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        if "libtcmalloc_minimal.so.4" in line and "=>" in line:
            found.append(line.split("=>")[1].strip())
            break
    venv = Path(python).parent.parent
    iomp = sorted(glob.glob(str(venv / "lib" / "libiomp5.so"))) or sorted(
        glob.glob(str(venv / "lib" / "python*" / "site-packages" / "**" / "libiomp5.so"), recursive=True)
    )
    found += iomp[:1]
    return ":".join(found)


def start_vllm_server(
    python: str, model_dir: Path, dtype: str, served_name: str, log_path: Path, threads: int
) -> ServerProcess:
    port = free_port()
    env = dict(os.environ)
    preload = vllm_preload(python)
    if preload:
        env["LD_PRELOAD"] = preload
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; our engine's CPU default is 1 GiB as well
        TQDM_DISABLE="1",
    )
    env.pop("PYTHONPATH", None)  # nothing of ours may shadow the peer's packages
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
    ]  # fmt: skip
    # Run from the log's folder: this repository's top-level packages (kernels/, graphs/) must not
    # shadow the peer's imports (`python -m` puts the working directory first on sys.path).
    return ServerProcess(command, log_path, env, url=f"http://127.0.0.1:{port}", cwd=log_path.parent)
