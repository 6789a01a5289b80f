"""Runs bench workloads in vLLM; executed by the vLLM venv's interpreter, never imported by ours.

    PYTHON bench/peers/vllm_runner.py      (bench/peers/runs.py starts it and talks to it)

A line protocol on stdin/stdout, so one vLLM engine serves a whole bench session for a model. The
first stdin line, JSON: model folder, dtype, engine limits and warm-up requests (run once after
start-up, as the bench session warms ours). Then one JSON line per case: a workload ("throughput":
every request through `LLM.generate`; "decode": requests added together and stepped by hand, as ours
is in bench/runners.py), its requests (prompt token ids, output length), warm-up and measured rounds.
Each answer is one stdout line, ANSWER_PREFIX + JSON (vLLM logs to stdout too): per measured round,
elapsed seconds, generated tokens and (decode) the seconds from the moment every request had its
first token to the last one. End of stdin ends the process.

Standard library and vllm only. The `__main__` guard is required: vLLM starts its engine core in a
spawned process, which re-imports this file.
"""

from __future__ import annotations

import json
import sys
import time


def _params(output_len: int):
    from vllm import SamplingParams

    # Greedy, exactly output_len tokens, no detokenising (ours produces token ids only too).
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False)


def _check(lengths: list[int], wanted: list[int]) -> None:
    if lengths != wanted:
        raise AssertionError(f"vLLM produced {lengths} tokens per request, wanted {wanted}")


def run_generate(llm, requests: list[dict]) -> dict:
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [_params(r["output_len"]) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    _check(lengths, [r["output_len"] for r in requests])
    return {"elapsed_s": elapsed, "tokens_generated": sum(lengths)}


def run_decode(llm, requests: list[dict], round_label: str) -> dict:
    engine = llm.llm_engine
    lengths: dict[str, int] = {}
    start = time.perf_counter()
    for i, r in enumerate(requests):
        request_id = f"{round_label}-{i}"
        engine.add_request(request_id, {"prompt_token_ids": r["prompt_token_ids"]}, _params(r["output_len"]))
        lengths[request_id] = 0
    first_all = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            lengths[out.request_id] = len(out.outputs[0].token_ids)
        if first_all is None and all(n > 0 for n in lengths.values()):
            first_all = time.perf_counter()
    end = time.perf_counter()
    got = list(lengths.values())
    _check(got, [r["output_len"] for r in requests])
    return {"elapsed_s": end - start, "tokens_generated": sum(got), "decode_s": end - first_all}


ANSWER_PREFIX = "@@bench-peer "


def answer(payload: dict) -> None:
    print(ANSWER_PREFIX + json.dumps(payload), flush=True)


def run_case(llm, case: dict) -> list[dict]:
    rounds = []
    for i in range(case["warmup_rounds"] + case["rounds"]):
        if case["workload"] == "decode":
            result = run_decode(llm, case["requests"], f"{case['key']}-{i}")
        else:
            result = run_generate(llm, case["requests"])
        if i >= case["warmup_rounds"]:
            rounds.append(result)
    return rounds


def main() -> None:
    job = json.loads(sys.stdin.readline())
    import vllm
    from vllm import LLM

    llm = LLM(
        model=job["model_dir"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        seed=0,
    )
    run_generate(llm, job["warm_requests"])
    run_generate(llm, job["warm_requests"][:1])
    answer({"ready": True, "version": vllm.__version__})
    for line in sys.stdin:
        if line.strip():
            case = json.loads(line)
            answer({"key": case["key"], "rounds": run_case(llm, case)})


if __name__ == "__main__":
    main()
