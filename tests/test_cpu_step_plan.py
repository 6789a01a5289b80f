"""CPU step plans (graphs/cpu_step_plan.py, kernels/cpu_ops.cpp's CpuStepPlan): a compiled
bucket's wrapper recorded once and replayed from C++, and the decode graphs capturing CPU buckets
on demand (graphs/decode_graphs.py)."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from compiled_engine.graphs import cpu_step_plan
from compiled_engine.graphs.compile_cache import CompileCache
from compiled_engine.graphs.compiled_step import CompiledStep
from compiled_engine.graphs.cpu_step_plan import StepPlanRefused, record_step_plan
from compiled_engine.graphs.device import CpuGraph
from compiled_engine.kernels import cpu_ops
from compiled_engine.kernels.backends import resolve_attention_backend
from compiled_engine.model_loader.loader import load_model
from compiled_engine.worker.input_buffers import InputBuffers
from tests.test_compiled_step import BLOCK_SIZE, _step, random_kv_caches

pytestmark = pytest.mark.skipif(
    cpu_ops.use_native_ops() is not None, reason="the C++ CPU ops are not built here"
)


def _wrapper_module(tmp_path, body: str):
    """A module shaped like Inductor's output code: a Runner whose `call` has `body`."""
    source = textwrap.dedent(
        """
        import torch
        empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
        reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
        aten = torch.ops.aten
        from torch._inductor.select_algorithm import extern_kernels

        class Runner:
            def call(self, args):
                arg0_1, arg1_1 = args
                args.clear()
        """
    ) + textwrap.indent(textwrap.dedent(body), " " * 8)
    path = tmp_path / "wrapper_module.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("wrapper_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Runner()


def test_a_wrapper_of_known_ops_replays_on_the_buffers_current_contents(tmp_path):
    runner = _wrapper_module(
        tmp_path,
        """
        buf0 = torch.ops.compiled_engine.cpu_gemv.default(arg0_1, arg1_1, None)
        buf1 = buf0
        del buf0
        return (reinterpret_tensor(buf1, (2, 24), (24, 1), 0), )
        """,
    )
    torch.manual_seed(0)
    x, weight = torch.randn(2, 40), torch.randn(24, 40)
    output, plan, refused = record_step_plan(lambda: runner.call([x, weight])[0])
    assert refused is None and plan is not None and plan.num_calls == 1
    torch.testing.assert_close(output, x @ weight.T, rtol=1e-5, atol=1e-5)
    x.copy_(torch.randn(2, 40))  # a new step's inputs, written in place
    replayed = plan.replay()
    assert replayed is output  # the same tensor, overwritten
    torch.testing.assert_close(replayed, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_extern_gemms_replay_into_their_out_buffers(tmp_path):
    runner = _wrapper_module(
        tmp_path,
        """
        buf0 = empty_strided_cpu((2, 24), (24, 1), torch.float32)
        extern_kernels.mm(arg0_1, reinterpret_tensor(arg1_1, (40, 24), (1, 40), 0), out=buf0)
        buf1 = empty_strided_cpu((2, 24), (24, 1), torch.float32)
        weight_t = reinterpret_tensor(arg1_1, (40, 24), (1, 40), 0)
        extern_kernels.addmm(buf0, arg0_1, weight_t, alpha=2, beta=3, out=buf1)
        return (buf1, )
        """,
    )
    torch.manual_seed(0)
    x, weight = torch.randn(2, 40), torch.randn(24, 40)
    _, plan, refused = record_step_plan(lambda: runner.call([x, weight])[0])
    assert refused is None and plan.num_calls == 2
    x.copy_(torch.randn(2, 40))
    torch.testing.assert_close(plan.replay(), 5 * (x @ weight.T), rtol=1e-5, atol=1e-5)


def test_timed_replays_give_each_calls_own_time_under_its_label(tmp_path):
    runner = _wrapper_module(
        tmp_path,
        """
        buf0 = torch.ops.compiled_engine.cpu_gemv.default(arg0_1, arg1_1, None)
        buf1 = empty_strided_cpu((2, 24), (24, 1), torch.float32)
        extern_kernels.mm(arg0_1, reinterpret_tensor(arg1_1, (40, 24), (1, 40), 0), out=buf1)
        return (buf1, )
        """,
    )
    x, weight = torch.randn(2, 40), torch.randn(24, 40)
    _, plan, refused = record_step_plan(lambda: runner.call([x, weight])[0])
    assert refused is None and plan.labels == ("compiled_engine::cpu_gemv", "aten::mm")
    plan.replay()
    assert plan.take_call_times().replays == 0  # not timed unless asked
    plan.time_calls()
    for _ in range(3):
        replayed = plan.replay()
    torch.testing.assert_close(replayed, x @ weight.T, rtol=1e-5, atol=1e-5)
    times = plan.take_call_times()
    assert times.replays == 3
    assert [label for label, _ in times.calls] == list(plan.labels)
    assert all(seconds > 0 for _, seconds in times.calls)
    again = plan.take_call_times()  # taken: the counts start again
    assert again.replays == 0 and all(seconds == 0 for _, seconds in again.calls)
    plan.time_calls(False)
    plan.replay()
    assert plan.take_call_times().replays == 0


def test_a_run_names_its_bad_arguments():
    plan = torch.classes.compiled_engine.CpuStepPlan()
    ids, positions = torch.zeros(2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64)
    lens, table = torch.ones(2, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32)
    slots, logits = torch.zeros(2), torch.zeros(2, 9)
    long_slots = slots.long()
    tokens = torch.zeros(3, 2, dtype=torch.int64)
    none = torch.empty(0)
    greedy, temperature, uniform = torch.zeros(2, dtype=torch.bool), torch.ones(2), torch.rand(2, 2)

    def run(kernel, tokens=tokens, slots=long_slots, table=table, logits=logits, positions=positions,
            draw=None):  # fmt: skip
        draws = (0, none, none, none) if draw is None else draw
        plan.decode_on(kernel, *draws, tokens, ids, positions, lens, slots, table, 16, logits)

    with pytest.raises(ValueError, match="a null greedy kernel"):
        run(0)
    with pytest.raises(ValueError, match="tokens must be a contiguous int64"):
        run(1, tokens=tokens.int())
    with pytest.raises(ValueError, match="slot_mapping must be Long with 2 contiguous columns, got Float"):
        run(1, slots=slots)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        run(1, table=table.long())
    with pytest.raises(ValueError, match="logits must be float"):
        run(1, logits=logits[:1])
    # A draw's rows: a greedy flag, a temperature and a uniform number a step for each.
    with pytest.raises(ValueError, match=r"greedy_rows must be a contiguous bool \[2\], got Int"):
        run(1, draw=(1, greedy.int(), temperature, uniform))
    with pytest.raises(ValueError, match=r"temperature must be a contiguous float32 \[2\], got Float \[3\]"):
        run(1, draw=(1, greedy, torch.ones(3), uniform))
    with pytest.raises(ValueError, match=r"uniform must be a contiguous float32 \[2, 2\], got Float \[1,"):
        run(1, draw=(1, greedy, temperature, uniform[:1]))
    # A row whose next position lies past its block table's 4 blocks of 16 (checked before a step runs).
    with pytest.raises(IndexError, match="row 0 reaches position 64 past its 4 blocks"):
        run(1, positions=torch.full((1, 2), 63))


@pytest.mark.parametrize(
    "body, reason",
    [
        # An aten op in the wrapper: Python-level maths the plan would not repeat.
        ("buf0 = aten.add.Tensor(arg0_1, arg0_1)\nreturn (buf0, )", "calls aten.add.Tensor"),
        ("for i in range(2):\n    pass\nreturn (arg0_1, )", "has a For statement"),
        ("arg0_1.add_(1)\nreturn (arg0_1, )", "calls arg0_1.add_"),
        # An op of ours the plan has no entry for.
        ("buf0 = torch.ops.compiled_engine.materialize.default(arg0_1)\nreturn (buf0, )", "does not replay"),
        # The output is memory no recorded call writes.
        ("return (arg0_1, )", "not memory the recorded calls write"),
    ],
)
def test_wrappers_the_plan_cannot_repeat_are_refused_with_the_reason(tmp_path, body, reason):
    runner = _wrapper_module(tmp_path, body)
    x = torch.randn(2, 40)
    output, plan, refused = record_step_plan(lambda: runner.call([x, torch.randn(24, 40)])[0])
    assert plan is None and reason in refused
    assert isinstance(output, torch.Tensor)  # the step itself still ran


def test_a_recorder_error_refuses_the_plan_and_keeps_the_steps_output(tmp_path, monkeypatch):
    runner = _wrapper_module(
        tmp_path, "buf0 = torch.ops.compiled_engine.cpu_gemv.default(arg0_1, arg1_1, None)\nreturn (buf0, )"
    )

    def broken(calls, output):
        raise OSError("no kernel symbol")

    monkeypatch.setattr(cpu_step_plan, "_build", broken)
    x, weight = torch.randn(2, 40), torch.randn(24, 40)
    output, plan, refused = record_step_plan(lambda: runner.call([x, weight])[0])
    assert plan is None and refused == "recording failed: OSError: no kernel symbol"
    torch.testing.assert_close(output, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_a_plan_whose_first_replay_differs_is_dropped_and_the_recorded_output_kept(tmp_path, monkeypatch):
    runner = _wrapper_module(
        tmp_path, "buf0 = torch.ops.compiled_engine.cpu_gemv.default(arg0_1, arg1_1, None)\nreturn (buf0, )"
    )
    replay = cpu_step_plan.CpuStepPlan.replay

    def off_by_one(self):
        return replay(self).add_(1.0)

    monkeypatch.setattr(cpu_step_plan.CpuStepPlan, "replay", off_by_one)
    x, weight = torch.randn(2, 40), torch.randn(24, 40)
    output, plan, refused = record_step_plan(lambda: runner.call([x, weight])[0])
    assert plan is None and refused == "a replay right after recording did not give the recorded output"
    torch.testing.assert_close(output, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_a_step_without_an_inductor_wrapper_is_refused():
    output, plan, refused = record_step_plan(lambda: torch.ones(3) * 2)
    assert plan is None and "0 Inductor wrappers" in refused
    assert torch.equal(output, torch.full((3,), 2.0))


def test_a_fused_kernel_with_a_float_argument_is_refused():
    with pytest.raises(StepPlanRefused, match="takes a float argument"):
        call = cpu_step_plan._KernelCall(name="cpp_fused_test", binding=None, args=(torch.ones(2), 0.5))
        cpu_step_plan._build([call], torch.ones(2))


def test_the_cpp_plan_names_its_bad_input():
    plan = torch.classes.compiled_engine.CpuStepPlan()
    with pytest.raises(Exception, match="a null kernel"):
        plan.add_kernel(0, [])
    with pytest.raises(Exception, match="at most 96"):
        plan.add_kernel(1, [0] * 97)
    x, weight = torch.randn(1, 8), torch.randn(4, 8)
    assert not plan.add_op("not_an_op", [x], [], [], torch.empty(1, 4))
    assert not plan.add_op("cpu_gemv", [x], [], [], torch.empty(1, 4))  # too few tensors
    assert plan.add_op("cpu_gemv", [x, weight], [], [], torch.empty(1, 5))  # checked when run
    with pytest.raises(Exception, match=r"a linear's output must be a contiguous Float \[1, 4\]"):
        plan.run()
    assert plan.size() == 1
    attention = torch.classes.compiled_engine.CpuStepPlan()
    query, key = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    index = [torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), torch.tensor([0, 1])]
    tensors = [query, key, key.clone(), torch.zeros(2, 4, 4, 1, 8), *index]
    assert attention.add_op("paged_attention_cpu", tensors, [0.35, 0.0], [-1], torch.empty(1, 2, 4))
    message = r"paged_attention_cpu's output must be a contiguous Float \[1, 2, 8\]"
    with pytest.raises(Exception, match=message):
        attention.run()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_an_op_that_allocates_its_output_is_copied_into_the_recorded_one():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    out = torch.empty(3, 8)
    plan = torch.classes.compiled_engine.CpuStepPlan()
    assert plan.add_op("onednn_linear", [x, weight, bias], [], [], out)
    plan.run()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def steps(llama_dir, tmp_path_factory):
    loaded = load_model(llama_dir, dtype="float32")
    caches = random_kv_caches(loaded.model_config)
    backend = resolve_attention_backend("cpu", "cpu")
    # One cache entry for both steps: the first to compile a bucket decides how its linears run
    # (graphs/gemv_policy.py times them) and the other reads that decision, so the two run the same
    # kernels and their logits can be compared bit for bit. Each timing its own could pick another
    # form where two measure alike (it did under CI's two workers).
    cache = CompileCache(tmp_path_factory.mktemp("plan-cache"))
    entry = cache.entry({"format": "1", "test": "cpu-step-plan"})
    steps = []
    for max_plan_tokens in (16, 0):  # plans; and one that always calls its artifacts
        buffers = InputBuffers(64, 4, 256, BLOCK_SIZE, torch.device("cpu"))
        step = CompiledStep(
            loaded.model, caches, buffers.whole(), (1, 2, 4, 8), attention_backend=backend,
            max_plan_tokens=max_plan_tokens, cache=entry,
        )  # fmt: skip
        steps += [step, buffers]
    return (*steps, caches)


def _run(step, buffers, spec):
    with torch.inference_mode():
        return step(buffers.prepare(_step(spec)).inputs).clone()


def test_decode_steps_capture_their_bucket_once_it_is_compiled_and_replay_it(steps):
    planned, buffers, plain, plain_buffers, caches = steps
    graphs = lambda: planned.decode_graphs.graphs  # noqa: E731
    first = [(1, 20, True), (1, 7, True)]
    # The bucket is not compiled yet: this step compiles it and runs the artifact (no capture).
    before = [c.clone() for c in caches]
    planned_logits = _run(planned, buffers, first)
    assert graphs() is None or not graphs().has(2)
    for cache, saved in zip(caches, before, strict=True):
        cache.copy_(saved)
    for spec in (first, [(1, 21, True), (1, 8, True)], [(1, 40, True), (1, 3, True)]):
        before = [c.clone() for c in caches]
        expected = _run(plain, plain_buffers, spec)
        plain_caches = [c.clone() for c in caches]
        for cache, saved in zip(caches, before, strict=True):
            cache.copy_(saved)
        planned_logits = _run(planned, buffers, spec)
        graph = graphs()._graphs[2]
        assert isinstance(graph, CpuGraph) and graph.plan is not None, graph.refused
        torch.testing.assert_close(planned_logits, expected, rtol=0, atol=0)
        for ours, theirs in zip(caches, plain_caches, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # A plan's calls: per layer its fused kernels and ops, all of them C++, each labelled.
    assert graph.plan.num_calls >= 2 * len(caches)
    labels = graph.plan.labels
    assert len(labels) == graph.plan.num_calls
    assert any(label.startswith("cpp_fused") for label in labels)
    assert labels.count("compiled_engine::paged_attention_cpu") == len(caches)
    # A prefill step is no decode batch: the bucket graph runs, nothing more is captured.
    _run(planned, buffers, [(3, 0, True)])
    assert graphs().captured_buckets == (2,)


def test_buckets_above_the_on_demand_limit_are_not_captured(steps, monkeypatch):
    planned, buffers, _, _, _ = steps
    monkeypatch.setattr(planned.decode_graphs, "max_on_demand_tokens", 2)
    spec = [(1, 9, True)] * 3  # bucket 4
    _run(planned, buffers, spec)
    _run(planned, buffers, spec)
    graphs = planned.decode_graphs.graphs
    assert graphs is None or not graphs.has(4)


def test_new_kv_caches_drop_the_plans_and_the_next_decode_recaptures(steps):
    planned, buffers, _, _, caches = steps
    _run(planned, buffers, [(1, 5, True)])
    _run(planned, buffers, [(1, 6, True)])
    assert planned.decode_graphs.graphs.has(1)
    planned.set_kv_caches(new_caches := [c.clone() for c in caches])
    assert planned.decode_graphs.graphs is None
    _run(planned, buffers, [(1, 6, True)])
    graph = planned.decode_graphs.graphs._graphs[1]
    plan = graph.plan
    assert plan is not None, graph.refused
    held = {t.data_ptr() for t in plan.keep}
    assert all(c.data_ptr() in held for c in new_caches)
    assert not any(c.data_ptr() in held for c in caches)
    planned.set_kv_caches(caches)


def test_the_engine_replays_plans_for_its_small_decode_buckets_and_generates_the_same(llama_dir, tmp_path):
    from compiled_engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 8]} for i in range(3)]
    outputs, graphs = {}, {}
    for limit in (0, 16):
        llm = LLM(llama_dir, dtype="float32", max_num_seqs=4, max_model_len=64, compile_buckets=[1, 2, 4, 16],
                  cache_dir=str(tmp_path), compile_policy="blocking", attention_backend="cpu",
                  max_cpu_plan_tokens=limit)  # fmt: skip
        outputs[limit] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        outputs[limit] += [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params, use_tqdm=False)]
        graphs[limit] = llm.engine.model_runner.step_graph.decode_graphs.graphs
        llm.close()
    assert graphs[0] is None  # 0: no plans
    assert set(graphs[16].captured_buckets) == {1, 4}  # three requests decode in bucket 4, one in 1
    assert all(graphs[16]._graphs[b].plan is not None for b in (1, 4))
    assert outputs[16] == outputs[0]
