"""The runner's persistent batch: one row per running request, kept across steps.

Staging a step used to rebuild its block table and sampling settings from every scheduled
request, every step. Here each request gets a row the first time a step schedules it, and the
row is updated in place: a step writes only the blocks a request gained since its last step
(blocks only grow until the request is finished or preempted), and the sampling settings are
written once, when the row is made. A step's staging then gathers its rows with numpy.

Rows leave when the scheduler reports the request finished or preempted (`SchedulerOutput`'s
`finished_request_ids` and `preempted_request_ids`, applied before the step's own requests), or
when the runner forgets the request (`remove`). A preempted request that comes back gets a new
row from its new block list. Every `ScheduledRequest` still carries its whole block list, so a
row can always be rebuilt: after a failed step the runner `clear`s the batch, and when rows run
out (departures the batch never heard of) the rows of requests the step does not schedule are
freed. What must never be missed is a preemption (the request's blocks change while its id
stays): the scheduler reports it in the step that preempts, and that step always runs (it
schedules at least the oldest running request, which the whole cache can hold).

Owned by the model runner (worker/model_runner.py), the only writer; staging reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat

import numpy as np

from compiled_engine.records.scheduler_output import ScheduledRequest, SchedulerOutput
from compiled_engine.sampling_params import SamplingParams


class PersistentBatch:
    """Rows of per-request state the runner keeps across steps (see the module docstring)."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int) -> None:
        self.max_rows = max_rows
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))  # popped from the end: row 0 first
        # The last step's request ids and their rows, while no row has come or gone since: most
        # decode steps schedule the same requests in the same order, and then one tuple
        # comparison stands in for a dict lookup per request.
        self._last_ids: tuple[str, ...] | None = None
        self._last_rows = np.zeros(0, dtype=np.int64)
        self.block_table = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        # Sampling settings, as the sampler's buffers hold them (greedy rows: temperature 1).
        self.temperature = np.ones(max_rows, dtype=np.float32)
        self.top_k = np.full(max_rows, -1, dtype=np.int64)
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.greedy = np.ones(max_rows, dtype=bool)
        # Rows whose sampling needs more than those arrays: penalties, logit_bias, min_tokens,
        # a seed, logprobs or prompt logprobs (staging looks at their params one by one).
        self.special = np.zeros(max_rows, dtype=bool)

    def __len__(self) -> int:
        return len(self.row_of)

    def clear(self) -> None:
        """Forget every row (after a failed step: rows are rebuilt from the next steps)."""
        self.row_of.clear()
        self._free_rows = list(range(self.max_rows - 1, -1, -1))
        self._last_ids = None
        self.num_blocks[:] = 0

    def remove(self, request_ids: Iterable[str]) -> None:
        """Free the rows of requests that left the running set (unknown ids are ignored)."""
        row_of, free_rows = self.row_of, self._free_rows
        self._last_ids = None
        for request_id in request_ids:
            row = row_of.pop(request_id, None)
            if row is not None:
                self.num_blocks[row] = 0
                free_rows.append(row)

    def update(
        self,
        step: SchedulerOutput,
        columns: tuple[Sequence[str], Sequence[tuple[int, ...]]] | None = None,
    ) -> np.ndarray:
        """Apply the step's departures, give its new requests rows and write the blocks each
        request gained; returns each scheduled request's row, in scheduling order. `columns`:
        the scheduled requests' ids and block lists, when the caller has them already."""
        if step.finished_request_ids:
            self.remove(step.finished_request_ids)
        if step.preempted_request_ids:
            self.remove(step.preempted_request_ids)
        reqs = step.scheduled
        n = len(reqs)
        if not n:
            return np.zeros(0, dtype=np.int64)
        if columns is None:
            # Columns of the records, transposed in C (one pass) rather than read field by field.
            request_ids, _, _, block_lists, *_ = zip(*reqs, strict=True)
        else:
            request_ids, block_lists = columns
        request_ids = tuple(request_ids)
        if request_ids == self._last_ids:  # the same requests as the last step, rows unchanged
            rows = self._last_rows
        else:
            rows = np.fromiter(map(self.row_of.get, request_ids, repeat(-1)), dtype=np.int64, count=n)
            new = (rows < 0).nonzero()[0].tolist()
            if len(new) > len(self._free_rows):
                self._reclaim(set(request_ids))
            for i in new:
                rows[i] = self._add(reqs[i])
            rows.flags.writeable = False  # handed out again while the same requests come back
            self._last_ids, self._last_rows = request_ids, rows
        num_blocks = np.fromiter(map(len, block_lists), dtype=np.int64, count=n)
        stored = self.num_blocks[rows]
        changed = (num_blocks != stored).nonzero()[0]
        if len(changed):
            self._write_blocks(reqs, rows, changed.tolist(), stored)
        return rows

    def _reclaim(self, keep: set[str]) -> None:
        """Free the rows of every request this step does not schedule. Departures reach the batch
        only with a step that runs (an empty step is never launched) or through `remove`, which a
        tensor-parallel rank 0 sends only for requests with sampling state; a row freed here from
        a request still running is simply rebuilt from its whole block list when it comes back."""
        self.remove([request_id for request_id in self.row_of if request_id not in keep])

    def _add(self, request: ScheduledRequest) -> int:
        if not self._free_rows:
            raise RuntimeError(f"a step schedules more requests than the batch's {self.max_rows} rows")
        row = self._free_rows.pop()
        self._last_ids = None
        self.row_of[request.request_id] = row
        self.block_table[row] = 0  # columns past its blocks read as 0, as in a table built afresh
        self._write_params(row, request.sampling_params)
        return row

    def _write_params(self, row: int, params: SamplingParams) -> None:
        greedy = params.greedy
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.special[row] = bool(
            params.has_penalties
            or params.logit_bias
            or params.min_tokens > 0
            or (params.seed is not None and not greedy)
            or params.logprobs is not None
            or params.prompt_logprobs is not None
        )

    def _write_blocks(
        self, reqs: Sequence[ScheduledRequest], rows: np.ndarray, changed: list[int], stored: np.ndarray
    ) -> None:
        table, num_blocks = self.block_table, self.num_blocks
        for i in changed:
            block_ids = reqs[i].block_ids
            row, known = int(rows[i]), int(stored[i])
            if len(block_ids) < known:
                # A list only shrinks by being freed, which removes the row first; rewrite it all.
                table[row] = 0
                known = 0
            table[row, known : len(block_ids)] = block_ids[known:]
            num_blocks[row] = len(block_ids)
