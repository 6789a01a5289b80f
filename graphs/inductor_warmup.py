"""Start Inductor's one-off CPU probes in the background while the engine loads the model.

On its first CPU compile or artifact load in a process, Inductor checks which vector instruction
sets the C++ compiler can build and load, by compiling a tiny file per candidate and `dlopen`-ing it
in a fresh Python subprocess each time: about 1 s here (11 subprocesses), paid by every warm start
before the first cached graph can be loaded. The work is almost all waiting on those subprocesses,
so a thread started before the model loads overlaps it with loading. The result is Inductor's own
(`functools.cache`d), so the graphs are built exactly as without the prefetch.
"""

from __future__ import annotations

import threading

import torch


def _probe_cpu_vec_isa() -> None:
    try:
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.pick_vec_isa()
    except Exception:  # noqa: BLE001 - the compile path runs the same probe and reports failures itself
        pass


def start_cpu_probes(device: torch.device) -> threading.Thread | None:
    """Start the probe thread for a CPU engine; None on other devices."""
    if device.type != "cpu":
        return None
    thread = threading.Thread(target=_probe_cpu_vec_isa, name="inductor-cpu-probe", daemon=True)
    thread.start()
    return thread


def finish_cpu_probes(thread: threading.Thread | None) -> None:
    """Import Inductor's compiler (≈1 s of Python, overlapping the probes' subprocesses), then wait for
    the probes: Inductor's cache of their result is not locked, so nothing may compile before they end."""
    if thread is None:
        return
    import torch._inductor.compile_fx  # noqa: F401

    thread.join()
