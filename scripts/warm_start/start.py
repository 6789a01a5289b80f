"""One fresh-process start: import, `LLM()` (timed: "LLM() to ready"), a 1-token request; prints one
JSON line. Runs on any version of the engine (the before side has no compile policy, no stats of
graphs). Usage: start.py MODEL_DIR KWARGS_JSON [all]  ("all": build every bucket after LLM(), as
`compiled-engine warmup` does, to fill a cache)."""

import json
import sys
import time

start = time.perf_counter()
from compiled_engine import LLM, SamplingParams  # noqa: E402  (the import is what is timed first)

imported = time.perf_counter()
llm = LLM(model=sys.argv[1], dtype="float32", **json.loads(sys.argv[2]))
built = time.perf_counter()
step = llm.engine.model_runner.step_graph
if sys.argv[3:] == ["all"]:
    from compiled_engine.entrypoints.warmup import warm_up_buckets

    warm_up_buckets(step, show_progress=False)
greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
llm.generate([{"prompt_token_ids": [3] * 16}], greedy, use_tqdm=False)
done = time.perf_counter()
info = {
    "import_s": imported - start,
    "llm_s": built - imported,
    "first_token_s": done - built,
    "traces": getattr(step, "num_traces", None),
    "compiles": sum(b.source == "compiled" for b in getattr(step, "builds", {}).values()),
}
stats = llm.stats()
if hasattr(stats, "graph_waits"):
    info["graph_waits"] = len(stats.graph_waits)
    info["graphs"] = stats.graphs.to_json()
print(json.dumps(info))
