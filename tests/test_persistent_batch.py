"""The runner's persistent batch: rows kept across steps stage exactly what a batch rebuilt from
each step alone stages, through joins, finishes, preemptions and prefix-cache hits."""

from __future__ import annotations

import random

import pytest
import torch

from compiled_engine.core.scheduler import Scheduler
from compiled_engine.core.scheduler_config import SchedulerConfig
from compiled_engine.records.request import Request
from compiled_engine.records.runner_output import ModelRunnerOutput
from compiled_engine.records.scheduler_output import ScheduledRequest, SchedulerOutput
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.worker.input_buffers import InputBuffers
from compiled_engine.worker.persistent_batch import PersistentBatch

CPU = torch.device("cpu")
BLOCK_SIZE = 4
MAX_SEQS = 6
STAGED_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "logits_indices")


def _staged_view(buffers: InputBuffers, slot, staged) -> dict[str, list]:
    """What the step reads: each buffer's front, the block table cut to the step."""
    inputs = buffers.load(slot, staged)
    view = {name: getattr(inputs, name).tolist() for name in STAGED_FIELDS}
    view["block_tables"] = inputs.block_tables.tolist()
    return view


@pytest.mark.parametrize("seed", range(4))
def test_persistent_rows_stage_what_a_fresh_batch_stages(seed):
    """A small KV cache forces preemptions; a shared prompt prefix gives prefix-cache hits;
    requests join and finish throughout. Each step is staged twice: through the batch kept
    across steps, and through a batch of that step alone (every row written from scratch)."""
    rng = random.Random(seed)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=MAX_SEQS,
            max_num_batched_tokens=32,
            max_model_len=64,
            block_size=BLOCK_SIZE,
            num_kv_blocks=20,
            enable_prefix_caching=True,
        )
    )
    kept = InputBuffers(32, MAX_SEQS, 64, BLOCK_SIZE, CPU)
    fresh = InputBuffers(32, MAX_SEQS, 64, BLOCK_SIZE, CPU)
    batch = PersistentBatch(kept.max_num_seqs, kept.max_blocks_per_seq)
    kept_slot, fresh_slot = kept.new_slot(), fresh.new_slot()
    shared_prefix = [rng.randrange(3, 50) for _ in range(2 * BLOCK_SIZE)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 20)) for _ in range(24)]
    next_id = 0
    saw_preemption = saw_finish = False
    for _ in range(200):
        if next_id < len(params) and rng.random() < 0.3:
            prompt = shared_prefix[: rng.randint(0, len(shared_prefix))]
            prompt += [rng.randrange(3, 50) for _ in range(rng.randint(1, 12))]
            scheduler.add_request(Request(f"r{next_id}", prompt, params[next_id]))
            next_id += 1
        step = scheduler.schedule()
        saw_preemption |= bool(step.preempted_request_ids)
        saw_finish |= bool(step.finished_request_ids)
        if step.is_empty:
            if not scheduler.has_unfinished_requests() and next_id == len(params):
                break
            continue
        staged = kept_slot.fill(step, None, {}, batch)
        assert staged == fresh_slot.fill(step)
        assert _staged_view(kept, kept_slot, staged) == _staged_view(fresh, fresh_slot, staged)
        for scheduled in step.scheduled:  # each row holds its request's whole block list
            row = batch.row_of[scheduled.request_id]
            assert batch.block_table[row, : len(scheduled.block_ids)].tolist() == list(scheduled.block_ids)
        ids = tuple(s.request_id for s in step.scheduled if s.sample)
        outputs = scheduler.update(step, ModelRunnerOutput(ids, tuple(rng.randrange(3, 50) for _ in ids)))
        # As the engine core does (runner.remove_requests): a step that reports them may never run.
        batch.remove(out.request_id for out in outputs if out.finished)
    assert saw_preemption and saw_finish
    assert len(batch) <= MAX_SEQS


def _decode(request_id: str, position: int, block_ids: tuple[int, ...]) -> ScheduledRequest:
    return ScheduledRequest(request_id, (5,), position, block_ids, True, SamplingParams(temperature=0.0), 1)


def test_rows_are_freed_when_requests_leave_and_reused():
    batch = PersistentBatch(max_rows=2, max_blocks_per_seq=4)
    rows = batch.update(SchedulerOutput((_decode("a", 3, (7,)), _decode("b", 3, (8,))), 2, (), ()))
    assert rows.tolist() == [0, 1]
    # "a" finished and "b" was preempted: both rows are free for the requests after them.
    rows = batch.update(SchedulerOutput((_decode("c", 3, (9,)), _decode("d", 3, (2,))), 2, ("b",), ("a",)))
    assert sorted(rows.tolist()) == [0, 1] and set(batch.row_of) == {"c", "d"}
    batch.remove(["c"])
    assert set(batch.row_of) == {"d"}
    with pytest.raises(RuntimeError, match="more requests than the batch's 2 rows"):
        batch.update(SchedulerOutput(tuple(_decode(r, 3, (1,)) for r in "xyz"), 3, (), ()))


def test_rows_of_departures_it_never_heard_of_are_reclaimed():
    """An empty step is never launched, so the finished ids it reports never reach the batch:
    when rows run out, those of requests the step does not schedule are freed."""
    batch = PersistentBatch(max_rows=2, max_blocks_per_seq=4)
    batch.update(SchedulerOutput((_decode("a", 3, (7,)), _decode("b", 3, (8,))), 2, (), ()))
    rows = batch.update(SchedulerOutput((_decode("b", 4, (8, 1)), _decode("c", 3, (9,))), 2, (), ()))
    assert set(batch.row_of) == {"b", "c"}
    assert batch.block_table[rows, :2].tolist() == [[8, 1], [9, 0]]


def test_a_row_takes_only_the_blocks_its_request_gained():
    batch = PersistentBatch(max_rows=1, max_blocks_per_seq=4)
    batch.update(SchedulerOutput((_decode("a", 3, (7,)),), 1, (), ()))
    batch.block_table[0, 0] = -5  # a write of the whole list would put 7 back
    batch.update(SchedulerOutput((_decode("a", 4, (7, 3)),), 1, (), ()))
    assert batch.block_table[0, :2].tolist() == [-5, 3] and batch.num_blocks[0] == 2


def test_the_same_requests_again_reuse_their_rows_until_a_row_comes_or_goes():
    """A step scheduling the same requests in the same order as the one before gets the same rows
    without looking them up; a departure (finished, preempted, removed, cleared) or a new row in
    between makes the next step look them up again, so a freed row is never handed out stale."""
    batch = PersistentBatch(max_rows=3, max_blocks_per_seq=4)
    first = batch.update(SchedulerOutput((_decode("a", 3, (7,)), _decode("b", 3, (8,))), 2, (), ()))
    again = batch.update(SchedulerOutput((_decode("a", 4, (7,)), _decode("b", 4, (8,))), 2, (), ()))
    assert again is first and not again.flags.writeable  # reused, and never written through
    # "a" finishes and comes back as a new request under the same id: the ids repeat, but its row
    # was freed and made again (its new blocks written, not the old row's kept).
    back = batch.update(SchedulerOutput((_decode("a", 3, (5,)), _decode("b", 5, (8,))), 2, (), ("a",)))
    assert back is not first
    assert batch.block_table[back, :1].tolist() == [[5], [8]]
    for forget in (lambda: batch.remove(["b"]), batch.clear):
        before = batch.update(SchedulerOutput((_decode("a", 3, (5,)), _decode("b", 3, (8,))), 2, (), ()))
        forget()
        after = batch.update(SchedulerOutput((_decode("a", 3, (5,)), _decode("b", 3, (8,))), 2, (), ()))
        assert after is not before and batch.block_table[after, :1].tolist() == [[5], [8]]
