"""Medians of run.sh's rounds: `LLM()` seconds per side, and after / before."""

import json
import statistics
import sys

rows: dict[str, list[dict]] = {}
for line in open(sys.argv[1]):
    side, _, payload = line.partition(" ")
    if payload.strip():
        rows.setdefault(side, []).append(json.loads(payload))
for side, runs in rows.items():
    seconds = [r["llm_s"] for r in runs]
    traces = sorted({r["traces"] for r in runs})
    rounds = [round(s, 2) for s in seconds]
    print(f"{side}: median {statistics.median(seconds):.2f} s, rounds {rounds}, traces {traces}")
before = statistics.median(r["llm_s"] for r in rows["before"])
for side in ("after-blocking", "after-background"):
    print(f"{side} / before: {statistics.median(r['llm_s'] for r in rows[side]) / before:.3f}")
