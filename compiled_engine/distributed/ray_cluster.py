"""Joining a Ray cluster, and the environment of the processes Ray starts for us.

Shared by the engine replicas on Ray (engine/ray_engine.py) and the tensor-parallel workers on Ray
(distributed/ray_workers.py). Ray is imported only when one of them is used.
"""

from __future__ import annotations

import os


def connect_ray() -> None:
    """Join the cluster RAY_ADDRESS names (a local one when unset), unless already connected."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=False)


def openmp_environment(environ) -> dict[str, str]:
    """A step-running process's environment: `environ`, and unless it chose an OpenMP wait policy,
    GNU OpenMP's short spin (1,000 rounds, what libgomp itself uses once a process has more OpenMP
    threads than cores). Its default in a process of one team spins 300,000 rounds after each
    parallel region, which on a machine with more runnable threads than cores (the server, its
    clients) keeps a waiting thread on a core the thread with the work needs: steps measured
    3-9x slower on 2 shared cores (docs/performance.md)."""
    env = dict(environ)
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = "1000"
    return env
