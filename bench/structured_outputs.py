"""What JSON-constrained decoding costs: throughput of one batch with half its requests constrained
to a JSON schema against the same batch with none constrained, in the same process, rounds
alternating (so machine noise hits both alike).

    .venv/bin/python -m bench.structured_outputs [--requests 64] [--max-tokens 64] [--rounds 3]

Every request runs to max_tokens (ignore_eos): both batches generate the same number of tokens,
so the time ratio is the cost. The schema (a list of up to 32 records) keeps a constrained row
inside its grammar for the whole run, so each of its steps fills a real mask. Prints each round
and the median times; docs/benchmarks.md quotes a run.
"""

from __future__ import annotations

import argparse
import statistics
import time

from compiled_engine import LLM, SamplingParams, StructuredOutputsParams

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


def timed(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args(argv)
    llm = LLM(enforce_eager=args.enforce_eager, max_num_seqs=args.requests, compile_policy="blocking")
    plain = batch(args.requests, args.max_tokens, constrained=False)
    mixed = batch(args.requests, args.max_tokens, constrained=True)
    timed(llm, *plain)  # warm-up: every bucket and the grammar compiled before timing
    timed(llm, *mixed)
    times: dict[str, list[float]] = {"none": [], "half JSON": []}
    for round_index in range(args.rounds):
        for name, (prompts, params) in (("none", plain), ("half JSON", mixed)):
            seconds, tokens = timed(llm, prompts, params)
            times[name].append(seconds)
            print(
                f"round {round_index}: {name:9s} {seconds:7.3f} s  "
                f"{tokens / seconds:8.1f} tok/s ({tokens} tokens)"
            )
    plain_s, mixed_s = statistics.median(times["none"]), statistics.median(times["half JSON"])
    print(
        f"median: none {plain_s:.3f} s, half JSON {mixed_s:.3f} s; "
        f"cost {100 * (mixed_s / plain_s - 1):+.1f}% "
        f"({args.requests} requests, {args.max_tokens} tokens each, "
        f"async_scheduling={llm.engine.async_scheduling})"
    )


if __name__ == "__main__":
    main()
