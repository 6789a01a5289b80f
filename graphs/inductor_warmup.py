"""Start Inductor's one-off CPU probes in the background, and wait for them only when needed.

On its first CPU compile or artifact load in a process, Inductor checks which vector instruction
sets the C++ compiler can build and load, by compiling a tiny file per candidate and `dlopen`-ing it
in a fresh Python subprocess each time: about 1 s here with a warm Inductor cache (11
subprocesses), ~15 s with a cold one (each candidate is a real g++ build). The work is almost all
waiting on those subprocesses, so a thread started before the model loads overlaps it with loading.
The result is Inductor's own (`functools.cache`d), so the graphs are built exactly as without the
prefetch.

Nothing waits for the probes until Inductor is about to run (`InductorProbes.wait`, called by the
compiled step before its first artifact load, compile or GEMV timing): an engine whose graphs
compile in the background process serves on its eager fallback at once, and a cold start's
`/health` does not wait for g++ (docs/compile-policy.md).
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


class InductorProbes:
    """The probe thread of one engine. `wait()` is safe from any thread and cheap once done."""

    def __init__(self, thread: threading.Thread | None) -> None:
        self._thread = thread
        self._lock = threading.Lock()

    @classmethod
    def start(cls, device: torch.device) -> InductorProbes:
        """Start the probe thread for a CPU engine; other devices have nothing to probe."""
        if device.type != "cpu":
            return cls(None)
        thread = threading.Thread(target=_probe_cpu_vec_isa, name="inductor-cpu-probe", daemon=True)
        thread.start()
        return cls(thread)

    def wait(self) -> None:
        """Import Inductor's compiler (≈1 s of Python, overlapping the probes' subprocesses), then
        wait for the probes: Inductor's cache of their result is not locked, so nothing may compile
        or load a graph before they end."""
        with self._lock:
            if self._thread is None:
                return
            import torch._inductor.compile_fx  # noqa: F401

            self._thread.join()
            self._thread = None
