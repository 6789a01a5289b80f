"""With the execution worker slowed down, the async loop never overwrites a staging slot a step
still reads, and never hands out a KV block a step in flight reads.

The checks are armed on a real async engine: each staged step's slot contents are snapshotted
when the host fills it and compared when the worker copies it to the device buffers; every block
the pool hands out is compared with the blocks of steps launched and not yet collected. A last
test disables the runner's wait on the slot and shows the slot check then fires.
"""

from __future__ import annotations

import time

import pytest
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.records.scheduler_output import ScheduledRequest, SchedulerOutput
from compiled_engine.worker.execution_stream import StepFailedError
from compiled_engine.worker.staging import StagingSlot

WORKER_DELAY_S = 0.01
SLOT_FIELDS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc")


class SlotChecker:
    """Snapshots a slot at fill time; `verify` fails if it changed before the step read it."""

    def __init__(self) -> None:
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.violations: list[str] = []
        self.loads = 0

    def arm(self, runner, monkeypatch) -> None:
        for slot in runner._slots:
            fill = slot.fill

            def checked_fill(step, *args, slot=slot, fill=fill):
                staged = fill(step, *args)
                self.snapshots[id(staged)] = {f: getattr(slot.buffers, f).clone() for f in SLOT_FIELDS}
                return staged

            monkeypatch.setattr(slot, "fill", checked_fill)
        load = runner.buffers.load

        def checked_load(slot: StagingSlot, staged, previous_samples=None):
            time.sleep(WORKER_DELAY_S)  # a slow device: the host runs ahead meanwhile
            snapshot = self.snapshots.pop(id(staged))
            changed = [
                name
                for name, before in snapshot.items()
                if not torch.equal(before, getattr(slot.buffers, name))
            ]
            if changed:
                self.violations.append(f"{changed} overwritten before the step read them")
                raise AssertionError(self.violations[-1])  # never run a step on torn inputs
            self.loads += 1
            return load(slot, staged, previous_samples)

        monkeypatch.setattr(runner.buffers, "load", checked_load)


def _arm_block_check(llm: LLM, monkeypatch) -> list[str]:
    runner = llm.engine.model_runner
    pool = llm.engine.core.scheduler.kv_cache_manager.block_pool
    allocate = pool.allocate
    violations: list[str] = []

    def checked_allocate(num_blocks: int) -> list[int]:
        blocks = allocate(num_blocks)
        reused = set(blocks) & runner.blocks_in_flight()
        if reused:
            violations.append(f"blocks {sorted(reused)} handed out while a step in flight reads them")
        return blocks

    monkeypatch.setattr(pool, "allocate", checked_allocate)
    return violations


@pytest.fixture(scope="module")
def async_llm(llama_dir):
    return LLM(
        llama_dir,
        dtype="float32",
        async_scheduling=True,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=24,  # tight: requests stop, get preempted and recycle blocks all the time
        max_num_seqs=6,
        max_num_batched_tokens=24,
        compile_buckets=(4, 16),
    )


def test_slow_worker_never_sees_a_reused_slot_or_block(async_llm, monkeypatch):
    runner = async_llm.engine.model_runner
    slots = SlotChecker()
    slots.arm(runner, monkeypatch)
    block_violations = _arm_block_check(async_llm, monkeypatch)
    prompts = [{"prompt_token_ids": [3 + (i * 5 + j) % 300 for j in range(4 + i % 20)]} for i in range(40)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=2 + i % 15, stop_token_ids=[7, 11]) for i in range(40)
    ]
    outputs = async_llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs) == 40 and slots.loads > 40
    assert slots.violations == []
    assert block_violations == []
    stats = async_llm.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.num_preemptions > 0


def _prefill(request_id: str, num_tokens: int, first_block: int) -> SchedulerOutput:
    greedy = SamplingParams(temperature=0.0)
    blocks = tuple(range(first_block, first_block + -(-num_tokens // 4)))
    scheduled = ScheduledRequest(request_id, (5,) * num_tokens, 0, blocks, True, greedy, 0)
    return SchedulerOutput((scheduled,), num_tokens, (), ())


def test_the_slot_check_fires_when_the_runner_does_not_wait_for_the_slot(async_llm, monkeypatch):
    """Three launches back to back (one more than the scheduler ever allows) on a slow worker: the
    third reuses the first one's slot. With the wait on `consumed` it is safe; without, the check
    sees the overwrite — so the check can fail."""
    runner = async_llm.engine.model_runner
    for disable_wait in (False, True):
        slots = SlotChecker()
        with monkeypatch.context() as patch:
            slots.arm(runner, patch)
            if disable_wait:
                for slot in runner._slots:
                    patch.setattr(slot.consumed, "synchronize", lambda: None)
            launched = [runner.launch(_prefill(f"r{i}", 3 + i, 4 * i)) for i in range(3)]
            if disable_wait:
                with pytest.raises(StepFailedError, match="overwritten"):
                    runner.collect(launched[0])
                runner.reset_after_failure()
            else:
                for step in launched:
                    runner.collect(step)
        assert bool(slots.violations) == disable_wait, slots.violations
