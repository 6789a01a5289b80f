"""A per-step trace of a server's engine process, for bench/cold_serving_variants.py `traced`.

Put this folder on PYTHONPATH with STEP_TRACE_OUT=PREFIX set: every interpreter started with it
(the server, its engine process, the background compiler) imports this file at start-up, and the
one that imports `compiled_engine.engine.llm_engine` wraps `LLMEngine.step` to record, per step:
(started, ended) perf_counter times, the tokens and sequences the step scheduled, how many of
those sequences carried a prompt chunk, and how many outputs the step returned. It writes them
to PREFIX.PID.json when the process exits. perf_counter is the system's monotonic clock, so the
times compare with the client's. Nothing here runs without STEP_TRACE_OUT.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys
import time

OUT = os.environ.get("STEP_TRACE_OUT")
TARGET = "compiled_engine.engine.llm_engine"
_records: list[tuple[float, float, int, int, int, int]] = []


def _wrap(module) -> None:
    engine_type = module.LLMEngine
    original_step = engine_type.step

    def step(self, *args, **kwargs):
        started = time.perf_counter()
        scheduler = self.core.scheduler
        schedule = scheduler.schedule
        seen = [0, 0, 0]

        def traced_schedule():
            out = schedule()
            prompts = sum(len(r.token_ids) > 1 for r in out.scheduled)
            seen[:] = [out.num_batched_tokens, len(out.scheduled), prompts]
            return out

        scheduler.schedule = traced_schedule
        try:
            outputs = original_step(self, *args, **kwargs)
        finally:
            del scheduler.schedule
        _records.append((started, time.perf_counter(), *seen, len(outputs)))
        return outputs

    engine_type.step = step

    def dump() -> None:
        with open(f"{OUT}.{os.getpid()}.json", "w") as f:
            json.dump(_records, f)

    atexit.register(dump)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.loader is not None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _wrap(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if OUT:
    sys.meta_path.insert(0, _WrapOnImport())
