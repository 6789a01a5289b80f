"""Multi-step scheduling (`num_scheduler_steps`): greedy or sampled decode steps run back to back
in one schedule, each fed the tokens the one before picked, and return as runs
(core/scheduler.py `_run_steps` / `_update_runs`, worker/model_runner.py `_run_on`)."""

from __future__ import annotations

import pytest
import torch

from bench.step_profile import main as step_profile_main
from compiled_engine import LLM, EngineArgs, SamplingParams
from compiled_engine.core.scheduler_config import SchedulerConfig
from compiled_engine.engine_args import MAX_SCHEDULER_STEPS
from compiled_engine.records.scheduler_output import ScheduledRequest, SchedulerOutput
from compiled_engine.speculative_config import SpeculativeConfig
from compiled_engine.worker.staging import StagingSlot
from compiled_engine.worker.step_buffers import BufferSizes
from tests.test_bench_peers import _run_pytest

PROMPTS = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 8, 41]} for i in range(3)]


def _engine(llama_dir, cache_dir, steps: int, max_num_seqs: int = 4, plan_tokens: int = 16) -> LLM:
    return LLM(llama_dir, dtype="float32", max_num_seqs=max_num_seqs, max_model_len=64,
               compile_buckets=[1, 2, 4, 16], cache_dir=str(cache_dir), compile_policy="blocking",
               attention_backend="cpu", num_scheduler_steps=steps,
               max_cpu_plan_tokens=plan_tokens)  # fmt: skip


def _generate(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[list, int]:
    """Each request's (tokens, finish reason, stop reason) and the engine steps they took."""
    engine = llm.engine
    ids = []
    for processed, checked in engine.validate(prompts, params):
        ids.append(engine.next_request_id())
        engine.add_request(ids[-1], processed, checked)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                first = out.outputs[0]
                done[out.request_id] = (tuple(first.token_ids), first.finish_reason, first.stop_reason)
    return [done[i] for i in ids], steps


def test_runs_generate_what_single_steps_generate_and_free_every_block(llama_dir, tmp_path):
    greedy = [SamplingParams(max_tokens=n, temperature=0.0) for n in (11, 7, 3)]
    results, steps, texts = {}, {}, {}
    stop_text = None
    for k in (1, 5):
        llm = _engine(llama_dir, tmp_path, k)
        results[k], steps[k] = _generate(llm, PROMPTS, greedy)
        # A stop string met inside a run: the text ends as with single steps.
        (plain,) = llm.generate(PROMPTS[:1], greedy[:1], use_tqdm=False)
        stop_text = stop_text or plain.outputs[0].text[4:7]
        stops = SamplingParams(max_tokens=11, temperature=0.0, stop=[stop_text])
        (cut,) = llm.generate(PROMPTS[:1], [stops], use_tqdm=False)
        texts[k] = (plain.outputs[0].text, cut.outputs[0].text, cut.outputs[0].finish_reason)
        # Three rows decode in bucket 4, which replays a recorded plan: the runs went on in C++.
        assert llm.engine.model_runner.step_graph.decode_plan(3) is not None
        # A stop token met inside a run ends the request there: what follows it is dropped.
        stop = results[1][0][0][5] if k == 5 else None
        if stop is not None:
            params = SamplingParams(max_tokens=11, temperature=0.0, stop_token_ids=[stop])
            stopped, _ = _generate(llm, PROMPTS[:1], [params])
            first = results[1][0][0].index(stop)
            assert stopped[0] == (results[1][0][0][: first + 1], "stop", stop)
        manager = llm.engine.core.scheduler.kv_cache_manager
        assert manager.num_free_blocks == manager.num_blocks  # the runs' blocks came back
        llm.close()
    assert results[5] == results[1]
    assert [len(tokens) for tokens, _, _ in results[1]] == [11, 7, 3]
    assert texts[5] == texts[1] and texts[1][2] == "stop" and len(texts[1][1]) < len(texts[1][0])
    # Without plans (Inductor's wrapper every step) a run's steps go through the step graph.
    llm = _engine(llama_dir, tmp_path, 5, plan_tokens=0)
    assert _generate(llm, PROMPTS, greedy) == (results[1], steps[5])
    assert llm.engine.model_runner.step_graph.decode_plan(3) is None
    llm.close()
    # The prefill, then runs of up to 5 tokens (never past the request with the fewest left),
    # where single steps take one engine step a token.
    assert steps[1] == 11 and steps[5] < steps[1]


def test_temperature_draws_run_and_sample_what_single_steps_sample(llama_dir, tmp_path):
    # Rows that draw with a temperature alone run beside a greedy row, one from the engine's
    # generator, one seeded (its own generator a step): a run draws the uniform numbers single steps
    # draw, in their order, so the tokens are the same.
    params = [
        SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.3, seed=11, ignore_eos=True),
    ]
    results, steps = {}, {}
    for k, plan_tokens in ((1, 16), (4, 16), (4, 0)):
        llm = _engine(llama_dir, tmp_path, k, plan_tokens=plan_tokens)
        results[k, plan_tokens], steps[k, plan_tokens] = _generate(llm, PROMPTS, params)
        assert (llm.engine.model_runner.step_graph.decode_plan(3) is not None) == (plan_tokens > 0)
        manager = llm.engine.core.scheduler.kv_cache_manager
        assert manager.num_free_blocks == manager.num_blocks
        llm.close()
    assert results[4, 16] == results[1, 16]  # runs in C++ (the plan's decode_on)
    assert results[4, 0] == results[1, 16]  # runs through the step graph and the sampler
    assert steps[4, 16] == steps[4, 0] < steps[1, 16]
    # The draws are draws: a sampled row's tokens are not what greedy picks for its prompt.
    greedy_llm = _engine(llama_dir, tmp_path, 1)
    greedy, _ = _generate(
        greedy_llm, PROMPTS, [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)] * 3
    )
    greedy_llm.close()
    assert greedy[1] == results[1, 16][1]
    assert greedy[0] != results[1, 16][0] or greedy[2] != results[1, 16][2]


@pytest.mark.parametrize("sampled", [{"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.05, "seed": 3}])
def test_top_k_top_p_and_min_p_rows_run_through_the_sampler(llama_dir, tmp_path, sampled):
    # Rows the C++ draw does not serve run in Python, each step through the step graph (its plan
    # replayed) and the sampler: still the tokens single steps sample.
    params = [
        SamplingParams(max_tokens=7, temperature=0.9, ignore_eos=True, **sampled),
        SamplingParams(max_tokens=7, temperature=0.8, ignore_eos=True),
    ]
    results, steps = {}, {}
    for k in (1, 4):
        llm = _engine(llama_dir, tmp_path, k)
        results[k], steps[k] = _generate(llm, PROMPTS[:2], params)
        llm.close()
    assert results[4] == results[1]
    assert steps[4] < steps[1]


def test_no_run_while_a_request_waits(llama_dir, tmp_path):
    greedy = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 2
    results, steps = {}, {}
    for k in (1, 4):
        llm = _engine(llama_dir, tmp_path, k, max_num_seqs=1)  # the second request waits for the first
        results[k], steps[k] = _generate(llm, PROMPTS[:2], greedy)
        llm.close()
    assert results[4] == results[1]
    # One at a time: 6 steps each. With runs of 4, the first request's steps stay single (the
    # second waits); the second, alone, takes its prefill, a run of 4 and one step for its last.
    assert (steps[1], steps[4]) == (12, 6 + 3)


@pytest.mark.parametrize("steps", [0, -1, MAX_SCHEDULER_STEPS + 1, 2.0, True, "4"])
def test_bad_num_scheduler_steps_is_refused_by_name(steps):
    with pytest.raises(ValueError, match="num_scheduler_steps must be an int from 1 to"):
        EngineArgs(num_scheduler_steps=steps)


@pytest.mark.parametrize(
    "options, conflict",
    [
        ({"async_scheduling": True}, "async_scheduling=True"),
        ({"speculative_config": SpeculativeConfig(method="ngram", num_speculative_tokens=2)}, "speculative"),
        ({"tensor_parallel_size": 2}, "tensor or pipeline parallelism"),
    ],
)
def test_num_scheduler_steps_refuses_what_a_run_cannot_take(options, conflict):
    with pytest.raises(ValueError, match=f"num_scheduler_steps=4 cannot run with {conflict}"):
        EngineArgs(num_scheduler_steps=4, **options)


def test_the_scheduler_config_refuses_runs_with_steps_in_flight():
    with pytest.raises(ValueError, match="num_scheduler_steps > 1 needs the synchronous loop"):
        SchedulerConfig(
            max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, num_kv_blocks=8,
            max_in_flight_steps=2, num_scheduler_steps=4,
        )  # fmt: skip


def test_staging_refuses_a_run_its_rows_do_not_share():
    greedy = SamplingParams(temperature=0.0)

    def row(name: str, tokens: tuple[int, ...], steps: int) -> ScheduledRequest:
        return ScheduledRequest(name, tokens, 8, (0, 1, 2, 3), True, greedy, 1, num_steps=steps)

    def fill(*rows: ScheduledRequest):
        slot = StagingSlot(BufferSizes(64, 4, 8), 4, torch.device("cpu"))
        return slot.fill(SchedulerOutput(rows, sum(len(r.token_ids) for r in rows), (), ()))

    assert fill(row("a", (5,), 3), row("b", (6,), 3)).num_steps == 3
    with pytest.raises(ValueError, match=r"a multi-step run needs every row .* got num_steps \(2, 3\)"):
        fill(row("a", (5,), 2), row("b", (6,), 3))
    with pytest.raises(ValueError, match="a multi-step run needs every row to decode one token"):
        fill(row("a", (5, 6), 2))  # a prompt chunk cannot run on


@pytest.mark.parametrize("value, message", [("0", "--bench-num-scheduler-steps must be >= 1, got 0"),
                                            ("two", "invalid int value: 'two'")])  # fmt: skip
def test_a_bad_bench_num_scheduler_steps_stops_the_bench_session(tmp_path, value, message):

    proc = _run_pytest(
        tmp_path, "bench/test_multi_step.py", "--collect-only", "--bench-num-scheduler-steps", value
    )
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_the_step_profile_refuses_steps_that_do_not_fit_its_context(capsys):
    with pytest.raises(SystemExit):
        step_profile_main(["--seqs", "1", "--context", "64", "--steps", "60", "--plan-calls"])
    assert "--steps 60 and 4 warm-up steps do not fit in --context 64" in capsys.readouterr().err
