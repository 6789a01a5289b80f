"""Keep the start-up heap out of the garbage collector's oldest-generation passes.

A serving process ends its start-up holding half a million objects or more (torch, transformers,
the traced graph, the tokenizer), almost none of which will ever be garbage. Python's collector
still walks all of them in each oldest-generation collection, which comes at an unpredictable
moment and held the process for ~270–310 ms on this 2-core machine (the embedded model, eager):
every stream stalled at once (docs/performance.md, "No stalls"). Freezing them once start-up is
done moves them to the permanent generation, so later collections walk only what serving
allocated since. vLLM does the same in its engine core and API server processes.

Only processes of our own call it (the engine process, a Ray replica actor, the API server): an
in-process `LLM` leaves its caller's collector as it found it.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect start-up garbage once, then freeze every object still alive; returns how many
    objects are now frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
