"""StepBuffers: one declaration for the host slots and the device buffers, and the staging path
through it (fill on the host, load on the device) — penalties included, with the async loop's
placeholder token counted on the device."""

from __future__ import annotations

import pytest
import torch

from compiled_engine.records.request import TokenHistory
from compiled_engine.records.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from compiled_engine.sampling_params import SamplingParams
from compiled_engine.worker.input_buffers import InputBuffers
from compiled_engine.worker.sampler import SamplingTensors, process_logits
from compiled_engine.worker.staging import RequestState
from compiled_engine.worker.step_buffers import BufferSizes, GrowableBuffer, LogprobResults, StepBuffers

CPU = torch.device("cpu")
SIZES = BufferSizes.of(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, block_size=16)


def test_every_field_exists_on_host_and_device_with_its_declared_dtype_and_shape():
    host = StepBuffers.allocate(SIZES, CPU, host=True)
    device = StepBuffers.allocate(SIZES, CPU, host=False)
    specs = StepBuffers.specs()
    assert len(specs) >= 30  # every buffer of a step, in one record
    for name, spec in specs.items():
        for side in (host, device):
            value = getattr(side, name)
            if spec.dtype is None:
                assert isinstance(value, LogprobResults), name
                assert value.top_ids.dtype == torch.int64 and value.top_values.dtype == torch.float32
            elif spec.shape is None:
                assert isinstance(value, GrowableBuffer) and value.dtype == spec.dtype, name
            else:
                assert isinstance(value, torch.Tensor), name
                assert value.dtype == spec.dtype and tuple(value.shape) == spec.shape(SIZES), name
    assert tuple(host.input_ids.shape) == (1, 64) and tuple(host.block_tables.shape) == (4, 4)
    assert specs["sampled_tokens"].host_only and not specs["input_ids"].host_only


def test_a_misspelt_buffer_is_an_error_not_a_new_buffer():
    host = StepBuffers.allocate(SIZES, CPU, host=True)
    with pytest.raises(AttributeError):
        host.input_idz = torch.zeros(1)  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        _ = host.input_idz  # type: ignore[attr-defined]


def test_a_growable_buffer_doubles_and_keeps_its_dtype():
    buffer = GrowableBuffer(torch.float32, CPU, pin_memory=False)
    with pytest.raises(RuntimeError, match="before any step filled it"):
        buffer.front(1)
    buffer.take(3)[:] = torch.tensor([1.0, 2.0, 3.0])
    first = buffer.tensor
    assert buffer.front(3).tolist() == [1.0, 2.0, 3.0] and buffer.tensor is first  # 64 to start
    buffer.take(100)
    assert buffer.tensor is not first and buffer.tensor.numel() == 128 and buffer.dtype == torch.float32
    assert buffer.view(10, 10).shape == (10, 10)


def _decode(request_id: str, token_id: int, position: int, block: int, params, num_outputs: int):
    return ScheduledRequest(request_id, (token_id,), position, (block,), True, params, num_outputs)


def test_penalties_count_the_placeholder_token_the_device_fills_in():
    """Async loop: step N+1 is staged before step N's token reaches the history. The device must
    count that token (taken from step N's samples) exactly as if the host had known it."""
    penalised = SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.7)
    plain = SamplingParams(temperature=0.0)
    histories = {"a": TokenHistory([3, 4, 5]), "b": TokenHistory([6, 7])}
    for token_id in (9, 9):
        histories["a"].append(token_id)
    histories["b"].append(11)
    states = {rid: RequestState(history, frozenset()) for rid, history in histories.items()}
    # "a" and "b" each owe one output the previous step is still sampling (placeholders); "p"
    # is an unpenalised request between them.
    step = SchedulerOutput(
        (
            _decode("a", PLACEHOLDER_TOKEN_ID, 5, 0, penalised, 3),
            _decode("p", 8, 2, 1, plain, 1),
            _decode("b", PLACEHOLDER_TOKEN_ID, 3, 2, penalised, 2),
        ),
        3,
        (),
        (),
    )
    previous_samples = torch.tensor([21, 13, 9])  # the previous step sampled b: 13, a: 9 (rows 1, 2)
    buffers = InputBuffers(64, 4, 64, 16, CPU)
    slot = buffers.new_slot()
    staged = slot.fill(step, {"x": 0, "b": 1, "a": 2}, states)
    assert staged.num_penalised == 2 and staged.num_penalty_placeholders == 2
    inputs = buffers.load(slot, staged, previous_samples)
    assert inputs.input_ids.tolist() == [[9, 8, 13]]  # placeholders filled on the device
    got = buffers.sampling_tensors(staged, (None,) * 3, None)

    # The same rows built from the whole histories, the pending tokens included.
    expected = SamplingTensors.build(
        [penalised, plain, penalised],
        [None] * 3,
        CPU,
        prompt_token_ids=[[3, 4, 5], [], [6, 7]],
        output_token_ids=[[9, 9, 9], [], [11, 13]],
    )
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(process_logits(logits, got), process_logits(logits, expected))
    assert not torch.equal(process_logits(logits, got), logits)  # the penalties did change them
    # The host's view stayed without the pending tokens: staging copies nothing back into it.
    assert list(histories["a"].output_token_ids) == [9, 9]


def test_staging_refuses_a_penalised_request_without_its_history():
    buffers = InputBuffers(64, 4, 64, 16, CPU)
    step = SchedulerOutput((_decode("a", 5, 3, 0, SamplingParams(presence_penalty=0.5), 0),), 1, (), ())
    with pytest.raises(RuntimeError, match=r"need ModelRunner.add_request\(\)"):
        buffers.new_slot().fill(step, None, {})


@pytest.mark.parametrize("through_numpy", [True, False], ids=["numpy-copies", "torch-copies"])
def test_staged_steps_load_the_same_through_numpy_and_torch_copies(through_numpy):
    """On the CPU `load` copies through numpy views; elsewhere through torch. Both must put the
    same values in the step's buffers, for a decode-only all-greedy step (staging's shortcuts)
    and for a mixed one (a prompt chunk that does not sample, a sampled decode with top-k)."""
    greedy, top_k = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5)
    buffers = InputBuffers(64, 4, 64, 16, CPU)
    if not through_numpy:
        buffers._device_arrays = None  # the path a CUDA device takes
    slot = buffers.new_slot()

    decodes = SchedulerOutput(
        (_decode("a", 7, 13, 3, greedy, 1), _decode("b", 9, 4, 5, greedy, 2)), 2, (), ()
    )
    staged = slot.fill(decodes)
    assert staged.all_greedy and staged.sampled_request_ids == ("a", "b") and staged.grammar_bitmasks is None
    inputs = buffers.load(slot, staged)
    assert inputs.input_ids.tolist() == [[7, 9]] and inputs.positions.tolist() == [[13, 4]]
    assert inputs.slot_mapping.tolist() == [3 * 16 + 13, 5 * 16 + 4]
    assert inputs.seq_lens.tolist() == [14, 5] and inputs.query_start_loc.tolist() == [0, 1, 2]
    assert inputs.logits_indices.tolist() == [0, 1] and inputs.block_tables.tolist() == [[3], [5]]

    chunk = ScheduledRequest("c", (11, 12, 13), 0, (6,), False, greedy, 0)
    mixed = SchedulerOutput((chunk, _decode("d", 8, 2, 1, top_k, 1)), 4, (), ())
    staged = slot.fill(mixed)
    assert not staged.all_greedy and staged.needs_top_k and staged.sampled_rows == (1,)
    assert staged.sampled_request_ids == ("d",)
    inputs = buffers.load(slot, staged)
    assert inputs.input_ids.tolist() == [[11, 12, 13, 8]] and inputs.positions.tolist() == [[0, 1, 2, 2]]
    assert inputs.slot_mapping.tolist() == [96, 97, 98, 18]
    assert inputs.seq_lens.tolist() == [3, 3] and inputs.query_start_loc.tolist() == [0, 3, 4]
    assert inputs.logits_indices.tolist() == [3]
    tensors = buffers.sampling_tensors(staged, (None,), None)
    assert tensors.temperature.tolist() == pytest.approx([0.7]) and tensors.top_k.tolist() == [5]
