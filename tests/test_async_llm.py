"""`AsyncLLM`: streaming, abort, concurrency on one continuous batch, failure isolation, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from compiled_engine import SamplingParams
from compiled_engine.engine.async_llm import (
    AsyncLLM,
    EngineClosedError,
    EngineDeadError,
    FinishedRequestStats,
    RequestOutputKind,
)
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine_args import EngineArgs
from compiled_engine.errors import InvalidRequestError

ENGINE_OPTIONS = dict(dtype="float32", max_model_len=128, enforce_eager=True, block_size=8, num_kv_blocks=160)
PROMPTS = ["def add(a, b):", "import os", "class Stack:", "for i in range(10):", "x = [1, 2, 3]"]


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


class FinishedRecorder:
    """A stats listener that keeps what it is told about finished requests."""

    def __init__(self) -> None:
        self.finished: dict[str, FinishedRequestStats] = {}
        self.first_tokens = 0

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        assert ttft_s >= 0 and num_prompt_tokens > 0
        self.first_tokens += 1

    def on_new_tokens(self, num_tokens: int, inter_token_s: float | None) -> None:
        assert num_tokens > 0

    def on_finished(self, stats: FinishedRequestStats) -> None:
        self.finished[stats.request_id] = stats


@pytest.fixture(scope="module")
def recorder():
    return FinishedRecorder()


@pytest.fixture(scope="module")
def engine(llama_dir, recorder):
    async_llm = AsyncLLM(LLMEngine(EngineArgs(model=llama_dir, **ENGINE_OPTIONS)), stats_listeners=[recorder])
    yield async_llm
    async_llm.shutdown()


@pytest.fixture
def fresh_engine(llama_dir):
    """An engine of its own, for tests that break or stop it."""
    async_llm = AsyncLLM(LLMEngine(EngineArgs(model=llama_dir, **ENGINE_OPTIONS)))
    yield async_llm
    async_llm.shutdown()


def _run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wait_until_idle(engine: AsyncLLM, timeout: float = 10.0):
    """The engine's stats once nothing runs or waits and every block is back in the pool."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (
            stats.num_running == 0
            and stats.num_waiting == 0
            and stats.num_free_kv_blocks == stats.num_kv_blocks
        ):
            return stats
        assert time.monotonic() < deadline, f"engine did not go idle: {stats}"
        time.sleep(0.01)


async def _final(engine: AsyncLLM, prompt, params, request_id=None):
    outs = [
        o async for o in engine.generate(prompt, params, request_id, output_kind=RequestOutputKind.FINAL_ONLY)
    ]
    assert len(outs) == 1 and outs[0].finished
    return outs[0]


def test_cumulative_stream_grows_to_the_final_output(engine):
    async def main():
        return [o async for o in engine.generate("def add(a, b):", _greedy(12))]

    outs = _run(main())
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 12 and len(outs) >= 2
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length"
    for earlier in outs[:-1]:
        assert final.token_ids[: len(earlier.outputs[0].token_ids)] == earlier.outputs[0].token_ids
        assert final.text.startswith(earlier.outputs[0].text)
    tokenizer = engine.tokenizer
    assert list(outs[-1].prompt_token_ids) == tokenizer("def add(a, b):")["input_ids"]
    assert final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True)


def test_delta_pieces_add_up_to_the_cumulative_result(engine):
    async def main():
        deltas = [
            o async for o in engine.generate("class Stack:", _greedy(10), output_kind=RequestOutputKind.DELTA)
        ]
        final = await _final(engine, "class Stack:", _greedy(10))
        return deltas, final

    deltas, final = _run(main())
    assert len(deltas) >= 2 and deltas[-1].finished
    assert "".join(d.outputs[0].text for d in deltas if d.outputs) == final.outputs[0].text
    tokens = tuple(t for d in deltas if d.outputs for t in d.outputs[0].token_ids)
    assert tokens == final.outputs[0].token_ids
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_concurrent_requests_share_the_batch_and_match_solo_runs(engine):
    params = [_greedy(8 + i % 5) for i in range(20)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(20)]

    async def main():
        solo = [await _final(engine, prompts[i], params[i]) for i in range(len(PROMPTS))]
        steps_before = engine.stats().num_steps
        together = await asyncio.gather(
            *(_final(engine, p, sp) for p, sp in zip(prompts, params, strict=True))
        )
        return solo, together, steps_before

    solo, together, steps_before = _run(main())
    for i, out in enumerate(together):
        expected = solo[i % len(PROMPTS)].outputs[0].token_ids
        n = len(out.outputs[0].token_ids)
        assert n == params[i].max_tokens
        assert out.outputs[0].token_ids == expected[:n]
    stats = wait_until_idle(engine)
    # 20 requests x 8-12 tokens each took far fewer steps than tokens: they ran in one batch.
    assert stats.num_steps - steps_before < sum(p.max_tokens for p in params) // 4


def test_abort_ends_the_stream_and_frees_its_blocks(engine):
    async def main():
        outs = []
        async for out in engine.generate("import os", _greedy(100), request_id="to-abort"):
            outs.append(out)
            if len(outs) == 3:
                await engine.abort("to-abort")
        return outs

    outs = _run(main())
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert 3 <= len(final.outputs[0].token_ids) < 100
    wait_until_idle(engine)
    # The id is free again once the request is gone.
    again = _run(_final(engine, "import os", _greedy(3), request_id="to-abort"))
    assert again.outputs[0].finish_reason == "length"


def test_leaving_the_stream_or_cancelling_aborts(engine, recorder):
    async def consume_forever(running: asyncio.Event):
        async for _ in engine.generate("x = [1, 2, 3]", _greedy(110), request_id="cancelled"):
            running.set()

    async def main():
        async for out in engine.generate("for i in range(10):", _greedy(110), request_id="left"):
            if len(out.outputs[0].token_ids) >= 2:
                break  # closing the generator aborts the request
        running = asyncio.Event()
        task = asyncio.create_task(consume_forever(running))
        await running.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(main())
    wait_until_idle(engine)
    for request_id in ("left", "cancelled"):
        stats = recorder.finished[request_id]
        assert stats.finish_reason == "abort" and stats.num_output_tokens < 110
    assert recorder.finished["left"].num_output_tokens >= 2


def test_a_bad_request_fails_alone(engine):
    good_params = _greedy(6)

    async def main():
        reference = await _final(engine, "def add(a, b):", good_params)
        good = [asyncio.create_task(_final(engine, "def add(a, b):", good_params)) for _ in range(4)]
        errors = []
        bad_prompts = [
            {"prompt_token_ids": [5, 10**6]},  # outside the vocabulary
            {"prompt_token_ids": [5] * 200},  # longer than max_model_len
            "",  # empty
        ]
        for bad in bad_prompts:
            with pytest.raises(InvalidRequestError) as info:
                await engine.add_request(f"bad-{len(errors)}", bad, good_params)
            errors.append(str(info.value))
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await engine.add_request("too-long", "def f():", _greedy(200))
        # A duplicate id is refused while the first request runs.
        long_stream = await engine.add_request("dup", "import os", _greedy(50))
        with pytest.raises(InvalidRequestError, match="already in use"):
            await engine.add_request("dup", "import os", good_params)
        await engine.abort("dup")
        assert [o async for o in long_stream][-1].outputs[0].finish_reason == "abort"
        return reference, await asyncio.gather(*good), errors

    reference, good, errors = _run(main())
    assert "vocabulary" in errors[0] and "max_model_len" in errors[1] and "empty" in errors[2]
    for out in good:
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    wait_until_idle(engine)


def test_the_event_loop_keeps_running_while_steps_run(fresh_engine):
    # The first steps of each shape trace graphs (Dynamo holds the GIL for long stretches then):
    # run the same request once before measuring.
    _run(_final(fresh_engine, "def add(a, b):", _greedy(4)))
    # Make every step slow (sleep releases the GIL, like a device step): if a step ran on the event
    # loop, the ticker below would stall for the whole step.
    inner_engine = fresh_engine._engine
    real_step = inner_engine.step

    def slow_step():
        time.sleep(0.2)
        return real_step()

    inner_engine.step = slow_step

    async def main():
        gaps = []

        async def ticker(stop: asyncio.Event):
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        stop = asyncio.Event()
        tick_task = asyncio.create_task(ticker(stop))
        out = await _final(fresh_engine, "def add(a, b):", _greedy(4))
        stop.set()
        await tick_task
        return out, gaps

    out, gaps = _run(main())
    assert len(out.outputs[0].token_ids) == 4
    assert len(gaps) > 50  # 4+ steps of 0.2 s: the loop ticked all along
    assert max(gaps) < 0.15


def test_engine_failure_reaches_every_waiter_and_later_callers(fresh_engine):
    inner_engine = fresh_engine._engine
    real_step = inner_engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("device fell over")
        return real_step()

    inner_engine.step = failing_step

    async def one(i):
        with pytest.raises(EngineDeadError) as info:
            async for _ in fresh_engine.generate(PROMPTS[i % len(PROMPTS)], _greedy(50)):
                pass
        return info.value

    async def main():
        errors = await asyncio.gather(*(one(i) for i in range(6)))
        with pytest.raises(EngineDeadError):
            await fresh_engine.add_request("late", "import os", _greedy(2))
        return errors

    errors = _run(main())
    assert all(isinstance(e.__cause__, RuntimeError) and "device fell over" in str(e) for e in errors)
    assert fresh_engine.errored and not fresh_engine.is_running


def test_shutdown_ends_running_requests_and_refuses_new_ones(fresh_engine):
    async def main():
        stream = await fresh_engine.add_request("running", "import os", _greedy(120))
        outputs = stream.outputs()
        await outputs.__anext__()
        # shutdown() joins the engine thread: run it off the loop, as a server's lifespan would.
        await asyncio.to_thread(fresh_engine.shutdown)
        with pytest.raises(EngineClosedError):
            async for _ in outputs:
                pass
        with pytest.raises(EngineClosedError):
            await fresh_engine.add_request("after", "import os", _greedy(2))

    _run(main())
    stats = fresh_engine.stats()
    assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    assert not fresh_engine.is_running and not fresh_engine.errored
    assert not fresh_engine._thread.is_alive()
