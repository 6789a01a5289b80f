"""What JSON-constrained decoding costs: throughput of one batch with half its requests constrained
to a JSON schema against the same batch with none constrained, in the same process, rounds
alternating (so machine noise hits both alike).

    .venv/bin/python -m bench.structured_outputs [--requests 64] [--max-tokens 64] [--rounds 5]

Every request runs to max_tokens (ignore_eos): both batches generate the same number of tokens,
so the time ratio is the cost. The schema (a list of up to 32 records) keeps a constrained row
inside its grammar for the whole run, so each of its steps fills a real mask. Prints each round,
the medians, and the seconds spent in the structured-output code; docs/performance.md quotes a run.
"""

from __future__ import annotations

import argparse
import statistics
import time

from compiled_engine import LLM, SamplingParams, StructuredOutputsParams
from compiled_engine.structured_output.logits_mask import GrammarMasks
from compiled_engine.structured_output.request_grammar import RequestGrammar

RECORDS = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 1,
            "maxItems": 32,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "name": {"type": "string", "maxLength": 12},
                },
                "required": ["id", "kind", "name"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["rows"],
    "additionalProperties": False,
}
PROMPTS = ("def parse(text):", "import json\n", "The table holds", "class Record:")


def batch(num_requests: int, max_tokens: int, constrained: bool) -> tuple[list[str], list[SamplingParams]]:
    """`num_requests` prompts; with `constrained`, every second one is JSON-constrained."""
    so = StructuredOutputsParams(json=RECORDS, disable_any_whitespace=True)
    prompts, params = [], []
    for i in range(num_requests):
        prompts.append(PROMPTS[i % len(PROMPTS)] + f" # {i}")
        params.append(
            SamplingParams(
                temperature=1.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                structured_outputs=so if constrained and i % 2 else None,
            )
        )
    return prompts, params


class StructuredTime:
    """Seconds spent in the structured-output code itself: the scheduler's mask fills (with the
    matcher catching up) and the runner's mask applications. A direct measure of the overhead,
    much less sensitive to a shared machine's noise than the wall-clock ratio."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for cls, name in ((RequestGrammar, "next_token_bitmask"), (GrammarMasks, "apply")):
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper


def timed(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, float, int]:
    """Wall and process CPU seconds of one generate call, and the tokens it generated."""
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return elapsed, cpu, sum(len(o.outputs[0].token_ids) for o in outputs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args(argv)
    llm = LLM(enforce_eager=args.enforce_eager, max_num_seqs=args.requests, compile_policy="blocking")
    plain = batch(args.requests, args.max_tokens, constrained=False)
    mixed = batch(args.requests, args.max_tokens, constrained=True)
    timed(llm, *plain)  # warm-up: every bucket and the grammar compiled before timing
    timed(llm, *mixed)
    structured = StructuredTime()
    wall: dict[str, list[float]] = {"none": [], "half JSON": []}
    cpu: dict[str, list[float]] = {"none": [], "half JSON": []}
    overhead: list[float] = []
    for round_index in range(args.rounds):
        for name, (prompts, params) in (("none", plain), ("half JSON", mixed)):
            before = structured.seconds
            seconds, cpu_seconds, tokens = timed(llm, prompts, params)
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
            line = f"round {round_index}: {name:9s} wall {seconds:7.3f} s  cpu {cpu_seconds:7.3f} s  "
            line += f"{tokens / seconds:7.1f} tok/s ({tokens} tokens)"
            if name == "half JSON":
                overhead.append(structured.seconds - before)
                line += f"; in structured-output code {overhead[-1]:.3f} s"
            print(line)

    def median(values: list[float]) -> float:
        return statistics.median(values)

    plain_wall, mixed_wall = median(wall["none"]), median(wall["half JSON"])
    plain_cpu, mixed_cpu = median(cpu["none"]), median(cpu["half JSON"])
    plain_pct = 100 * (mixed_wall / plain_wall - 1)
    cpu_pct = 100 * (mixed_cpu / plain_cpu - 1)
    print(f"median wall: none {plain_wall:.3f} s, half JSON {mixed_wall:.3f} s ({plain_pct:+.1f}%)")
    print(f"median cpu:  none {plain_cpu:.3f} s, half JSON {mixed_cpu:.3f} s ({cpu_pct:+.1f}%)")
    print(
        f"structured-output code: {median(overhead):.3f} s per run, "
        f"{100 * median(overhead) / plain_wall:.1f}% of the plain run's wall time"
    )
    print(
        f"({args.requests} requests, {args.max_tokens} tokens each, "
        f"async_scheduling={llm.engine.async_scheduling})"
    )


if __name__ == "__main__":
    main()
