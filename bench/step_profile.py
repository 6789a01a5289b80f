"""Where bench-small's compiled decode step spends its time, by kind of work, on this CPU.

N requests decode together at about `context` tokens each (fp32 unless --dtype, compiled buckets, sync loop);
after a few warm-up steps, `--steps` steps run under torch.profiler with Inductor's per-kernel
profiling on, and each profiled event's own time is put in one group:

- linears: oneDNN's matmuls (`mkldnn::_linear_pointwise`, graphs/passes/onednn_linear.py), the
  C++ GEMV (`compiled_engine::cpu_gemv`, graphs/passes/cpu_gemv.py) or torch's
  (`aten::mm`/`addmm`/`linear`), whichever the buckets run; quantized (`--quantization`), the
  quantized ops (`compiled_engine::cpu_gemv_int8` ... `int4_weight_linear`);
- attention: Inductor's fused kernels that do the paged-attention maths (their names carry
  `amax`, the softmax's max), the KV-cache write op and the query/block-id copies it reads;
- other graph kernels: every other Inductor kernel (norms, rotary, activations, residuals);
- graph wrapper and ops: everything else inside the compiled graph's call (its Python wrapper,
  small aten ops, allocations);
- outside the graph: the rest of the engine step (schedule, input staging, sampling, update,
  output processing), i.e. step wall time minus the graph's call.

    python -m bench.step_profile [--seqs 64] [--context 128] [--steps 10] [--attention-backend cpu]
                                 [--top N] [--dtype bfloat16]
                                 [--model qwen2.5-0.5b-shape] [--quantization int8|int4]
                                 [--max-cpu-plan-tokens 16]

Decode buckets run Inductor's Python wrapper here unless --max-cpu-plan-tokens says otherwise: a
step plan (graphs/cpu_step_plan.py) makes the same kernel calls from C++, which the profiler does
not see one by one (bench/test_step_plan.py times plans against the wrapper). `--plan-calls`
profiles the step as the engine runs it by default, plan and all, without torch.profiler: the
plan times each of its calls itself (kernels/cpu_ops.cpp's CpuStepPlan), and everything else in
the step (the graph call's own work, schedule, staging, sampling, update, outputs) is "outside the
plan's calls". Those steps run at their normal speed, so this is also the split to set beside a
TPOT.

The groups hold for buckets whose linears stay GEMMs. In GEMV-lowered buckets (a few rows,
graphs/gemv_policy.py) Inductor fuses the linears' multiply-sums with neighbouring kernels, the
attention's included, and the groups blur.

Needs its own compile cache (Inductor's kernel profiling changes the generated code), so it
uses a temporary one unless COMPILED_ENGINE_CACHE_DIR is set (`--plan-calls`: the engine's own);
cold, it compiles the buckets it needs (~1 min). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

GROUPS = ("linears", "attention", "other graph kernels", "graph wrapper and ops", "outside the graph")
_LINEAR_EVENTS = (
    "mkldnn::_linear_pointwise",
    "aten::mm",
    "aten::addmm",
    "aten::linear",
    "compiled_engine::cpu_gemv",
    "compiled_engine::cpu_gemv_int8",
    "compiled_engine::cpu_gemv_int4",
    "compiled_engine::cpu_gemm_int8",
    "compiled_engine::cpu_gemm_int4",
    "compiled_engine::int8_weight_linear",
    "compiled_engine::int4_weight_linear",
)
_ATTENTION_EVENTS = (
    "compiled_engine::kv_cache_write",
    "compiled_engine::materialize",
    "compiled_engine::paged_attention_cpu",
    "aten::index_copy_",
)
_GRAPH_CALL = "## Call CompiledFxGraph"


def _group(name: str) -> str | None:
    if name in _LINEAR_EVENTS:
        return "linears"
    if name.startswith(_ATTENTION_EVENTS) or ("cpp_fused" in name and "amax" in name):
        return "attention"
    if "cpp_fused" in name:
        return "other graph kernels"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--attention-backend", default="auto", help="as LLM(attention_backend=...)")
    parser.add_argument("--top", type=int, default=0, help="also list the N costliest events")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--model", default="bench-small", help="a bench model name (bench/models.py)")
    parser.add_argument(
        "--quantization", default=None, choices=("int8", "int4"), help="as LLM(quantization=...)"
    )
    parser.add_argument(
        "--max-cpu-plan-tokens",
        type=int,
        default=0,
        help="as LLM(max_cpu_plan_tokens=...); default 0: a step plan runs the kernels without the "
        "profiler's per-op events, so the groups below need the graph's Python wrapper",
    )
    parser.add_argument(
        "--plan-calls",
        action="store_true",
        help="time the decode buckets' step plans call by call (plans on, as the engine's default; "
        "no torch.profiler) instead of the profiler's events on the graphs' Python wrapper",
    )
    args = parser.parse_args(argv)
    if not args.plan_calls:
        os.environ["TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE"] = "1"  # read when Inductor is imported
    if "COMPILED_ENGINE_CACHE_DIR" not in os.environ and not args.plan_calls:
        os.environ["COMPILED_ENGINE_CACHE_DIR"] = tempfile.mkdtemp(prefix="compiled-engine-step-profile-")

    from torch.profiler import ProfilerActivity, profile

    from bench.models import resolve_model
    from compiled_engine import LLM, SamplingParams

    warmup = 4
    if args.steps + warmup >= args.context:
        parser.error(
            f"--steps {args.steps} and {warmup} warm-up steps do not fit in --context {args.context}: "
            "every step must decode (raise --context)"
        )
    prompt_len = args.context - args.steps - warmup
    max_len = args.context + 16
    llm = LLM(
        str(resolve_model(args.model).path),
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=args.seqs,
        max_num_batched_tokens=4096,
        num_kv_blocks=args.seqs * (max_len // 16 + 1),
        async_scheduling=False,
        compile_policy="blocking",  # graphs built in the warm-up steps, not swapped in mid-timing
        attention_backend=args.attention_backend,
        quantization=args.quantization,
        **({} if args.plan_calls else {"max_cpu_plan_tokens": args.max_cpu_plan_tokens}),
    )
    engine = llm.engine
    # Room to the end of the model length: requests that finish their prefill early decode during
    # the others' prefill, and none may finish (shrinking the batch) while steps are profiled.
    params = SamplingParams(max_tokens=max_len - prompt_len, temperature=0.0, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [3 + (i * 31 + j) % 3000 for j in range(prompt_len)]} for i in range(args.seqs)
    ]
    for processed, checked in engine.validate(prompts, params):
        engine.add_request(engine.next_request_id(), processed, checked)
    decoding: set[str] = set()
    while len(decoding) < args.seqs:  # the prefill (chunked: several steps for long prompts)
        decoding.update(out.request_id for out in engine.step())
    for _ in range(warmup):  # decode steps; the first builds (or loads) its bucket
        engine.step()
    if args.plan_calls:
        return _profile_plan_calls(engine, args)
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
    per_step = defaultdict(float)  # ms per step
    graph_ms = 0.0
    for event in prof.key_averages():
        own_ms = event.self_cpu_time_total / 1e3 / args.steps
        if event.key.startswith(_GRAPH_CALL):
            graph_ms += event.cpu_time_total / 1e3 / args.steps
            per_step["graph wrapper and ops"] += own_ms
            continue
        group = _group(event.key)
        per_step[group or "graph wrapper and ops"] += own_ms
    wall_ms = sum(walls) / len(walls) * 1e3
    # Events outside the graph's call were added to "graph wrapper and ops" above; move them out.
    inside = sum(per_step.values())
    per_step["graph wrapper and ops"] -= max(0.0, inside - graph_ms)
    per_step["outside the graph"] = wall_ms - graph_ms
    in_order = {group: per_step[group] for group in GROUPS}
    _print_groups(args, engine, "profiled steps", " under the profiler", walls, in_order)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    for event in events[: args.top]:
        ms = event.self_cpu_time_total / 1e3 / args.steps
        print(f"    {ms:7.3f} ms  {event.count // args.steps:4d}x  {event.key}")
    return 0


def _print_groups(args, engine, steps_were: str, timed_how: str, walls: list[float], per_step: dict) -> None:
    """The profile's header, then each group's milliseconds a step and share of the step."""
    wall_ms = sum(walls) / len(walls) * 1e3
    print(
        f"{args.model} {args.dtype}, {args.seqs} sequences at ~{args.context} tokens, "
        f"{args.steps} {steps_were}: "
        f"step {wall_ms:.2f} ms mean ({statistics.median(walls) * 1e3:.2f} median){timed_how}"
    )
    for group, ms in per_step.items():
        print(f"  {group:24s} {ms:7.2f} ms  {100 * ms / wall_ms:5.1f}%")
    print(f"  (attention backend: {engine.model_runner.attention_backend.name})")


PLAN_GROUPS = ("linears", "attention", "other graph kernels", "outside the plan's calls")


def plan_call_groups(calls: list[tuple[str, float]], steps: int, wall_s: float) -> dict[str, float]:
    """Milliseconds per step in each of PLAN_GROUPS, from the plans' (label, seconds) calls summed
    over `steps` steps of `wall_s` seconds in all."""
    per_step = dict.fromkeys(PLAN_GROUPS, 0.0)
    for label, seconds in calls:
        per_step[_group(label) or "other graph kernels"] += seconds * 1e3 / steps
    per_step["outside the plan's calls"] = wall_s * 1e3 / steps - sum(per_step.values())
    return per_step


def _profile_plan_calls(engine, args) -> int:
    graphs = engine.model_runner.step_graph.decode_graphs.graphs
    plans = [graphs.graph(b).plan for b in graphs.captured_buckets] if graphs is not None else []
    plans = [plan for plan in plans if plan is not None]
    if not plans:
        print("no decode bucket replays a step plan here (see the engine's log for why): nothing to time")
        return 1
    for plan in plans:
        plan.time_calls()
    walls = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    calls: list[tuple[str, float]] = []
    replays = 0
    for plan in plans:
        times = plan.take_call_times()
        plan.time_calls(False)
        replays += times.replays
        calls += times.calls
    if replays != args.steps:
        print(f"{replays} plan replays in {args.steps} steps: some steps ran no plan, the split is off")
    per_step = plan_call_groups(calls, args.steps, sum(walls))
    _print_groups(args, engine, "steps with the plans' calls timed", "", walls, per_step)
    by_label: dict[str, list[float]] = defaultdict(list)
    for label, seconds in calls:
        by_label[label].append(seconds * 1e3 / args.steps)
    for label, ms in sorted(by_label.items(), key=lambda item: sum(item[1]), reverse=True)[: args.top]:
        print(f"    {sum(ms):7.3f} ms  {len(ms):4d}x  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
