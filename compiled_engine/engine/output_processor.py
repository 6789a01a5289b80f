"""Turns token-level engine-core outputs into text-level `RequestOutput`s.

Owns one incremental detokenizer per live request; finds stop strings (which may span token
boundaries) and reports the requests they end, so the engine can stop them in the core. Turns
the core's logprobs records into vLLM's per-position dicts. A request with n > 1 runs in the
core as n child requests; they are gathered here into one RequestOutput with n completions,
finished when all of them are.

Each request's `SamplingParams.output_kind` says what it is told: CUMULATIVE, everything so far
(a snapshot of its token ids every step); DELTA, only this step's tokens and text; FINAL_ONLY,
one output when it ends, and, without stop strings, no text until then either (its tokens are
detokenized in one pass at the end: the same text, and no work per step).

Token ids are not kept here: each sequence reads its `TokenHistory`, the scheduler's record of
the request (engine/request.py). The core hands back one update's outputs per step and they are
processed before the next update, so the history then holds exactly the tokens reported so far.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from compiled_engine.engine.detokenizer import IncrementalDetokenizer
from compiled_engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from compiled_engine.records.engine_core_output import EngineCoreOutput
from compiled_engine.records.request import TokenHistory
from compiled_engine.records.runner_output import TokenLogprobs
from compiled_engine.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE = RequestOutputKind.CUMULATIVE
DELTA = RequestOutputKind.DELTA
FINAL_ONLY = RequestOutputKind.FINAL_ONLY

_Record = TypeVar("_Record", CompletionOutput, RequestOutput)


@dataclass
class _RequestState:
    """One sequence: a request with n == 1, or one child of a request with n > 1."""

    prompt: str | None
    history: TokenHistory  # the scheduler's, read here (outputs: what the core reported so far)
    detokenizer: IncrementalDetokenizer | None
    parent_id: str | None = None
    index: int = 0
    output_kind: RequestOutputKind = CUMULATIVE
    # FINAL_ONLY without stop strings: nothing is detokenized until the request ends.
    defer_text: bool = False
    text: str = ""  # all of it (DELTA: not kept)
    logprobs: SampleLogprobs | None = None  # a list when logprobs were asked
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class _ParentState:
    """A request with n > 1: the latest completion of each child, and how many finished."""

    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    child_ids: tuple[str, ...]
    completions: list[CompletionOutput]
    output_kind: RequestOutputKind = CUMULATIVE
    num_finished: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    # DELTA: the children's completions of this step, by index, until the parent's output is built.
    changed: dict[int, CompletionOutput] | None = None


@dataclass(frozen=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Requests a stop string ended here; the core must stop scheduling them.
    stopped_by_string: list[str]


def _build(record_type: type[_Record], **fields) -> _Record:
    """A frozen dataclass record (`RequestOutput`, `CompletionOutput`) built without its
    generated `__init__`, whose frozen assignments cost about a microsecond a field, and these are
    built for every request every step. Every field is given (no defaults are filled in) and
    these records have no `__post_init__`, so the result is the object `__init__` makes."""
    record = object.__new__(record_type)
    record.__dict__.update(fields)
    return record


for _record_type in (CompletionOutput, RequestOutput):
    if hasattr(_record_type, "__post_init__"):  # _build would skip it
        raise ImportError(f"{_record_type.__name__} gained a __post_init__: build it with its constructor")


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._parents: dict[str, _ParentState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        histories: Mapping[str, TokenHistory],
    ) -> None:
        """Register a request by the histories of the sequences the core runs for it, keyed by
        their core ids: the request's own id (n == 1), or one child id per sample, in sample order."""
        if params.n == 1:
            if list(histories) != [request_id]:
                raise ValueError(f"request {request_id!r} (n=1) runs under its own id, got {list(histories)}")
            self._states[request_id] = self._new_state(prompt, histories[request_id], params)
            return
        if len(histories) != params.n:
            raise ValueError(
                f"request {request_id!r} has n={params.n} samples, got {len(histories)} histories"
            )
        for index, (child_id, history) in enumerate(histories.items()):
            self._states[child_id] = self._new_state(prompt, history, params, request_id, index)
        empty = [
            CompletionOutput(index=i, text="", token_ids=(), finish_reason=None) for i in range(params.n)
        ]
        prompt_token_ids = next(iter(histories.values())).prompt_token_ids
        self._parents[request_id] = _ParentState(
            prompt,
            prompt_token_ids,
            tuple(histories),
            empty,
            params.output_kind,
            changed={} if params.output_kind is DELTA else None,
        )

    def _new_state(
        self,
        prompt: str | None,
        history: TokenHistory,
        params: SamplingParams,
        parent_id: str | None = None,
        index: int = 0,
    ) -> _RequestState:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, history.prompt_token_ids, stop=params.stop, min_tokens=params.min_tokens
            )
        kind = params.output_kind
        defer = kind is FINAL_ONLY and detok is not None and not detok.has_stop_strings
        state = _RequestState(prompt, history, detok, parent_id, index, kind, defer)
        if params.logprobs is not None:
            state.logprobs = []
            state.cumulative_logprob = 0.0
        return state

    def child_ids(self, request_id: str) -> list[str]:
        """The ids the core knows a request by: its children for n > 1, else itself."""
        parent = self._parents.get(request_id)
        return list(parent.child_ids) if parent is not None else [request_id]

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for child_id in self.child_ids(rid):
                self._states.pop(child_id, None)
            self._parents.pop(rid, None)
            self._states.pop(rid, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states or request_id in self._parents

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        # RequestOutputs in the order their first core output came; a parent's is built once,
        # after all of this step's child outputs are in.
        ordered: list[RequestOutput | str] = []
        touched_parents: set[str] = set()
        stopped: list[str] = []
        for out in core_outputs:
            state = self._states.get(out.request_id)
            if state is None:  # aborted or already ended by a stop string
                continue
            if state.defer_text and not (out.finished or state.logprobs is not None or out.prompt_logprobs):
                continue  # FINAL_ONLY, running, nothing to keep: most requests of LLM.generate
            completion = self._update(state, out, stopped)
            if completion is None:  # FINAL_ONLY, still running: nothing to report
                continue
            finished = completion.finish_reason is not None
            if finished:
                del self._states[out.request_id]
            if state.parent_id is None:
                ordered.append(
                    _build(
                        RequestOutput,
                        request_id=out.request_id,
                        prompt=state.prompt,
                        prompt_token_ids=state.history.prompt_token_ids,
                        outputs=(completion,),
                        finished=finished,
                        # DELTA: once, with the update that brought them.
                        prompt_logprobs=(
                            state.prompt_logprobs
                            if state.output_kind is not DELTA or out.prompt_logprobs is not None
                            else None
                        ),
                    )
                )
                continue
            parent = self._parents[state.parent_id]
            parent.completions[state.index] = completion
            if parent.changed is not None:
                parent.changed[state.index] = completion
            parent.num_finished += completion.finished
            if out.prompt_logprobs is not None:  # sample 0's, with its first token
                parent.prompt_logprobs = state.prompt_logprobs
            if parent.output_kind is FINAL_ONLY and parent.num_finished < len(parent.child_ids):
                continue
            if state.parent_id not in touched_parents:
                touched_parents.add(state.parent_id)
                ordered.append(state.parent_id)
        if not touched_parents:
            return ProcessedOutputs(ordered, stopped)  # type: ignore[arg-type]  # all RequestOutputs
        results = [item if isinstance(item, RequestOutput) else self._parent_output(item) for item in ordered]
        return ProcessedOutputs(results, stopped)

    def _update(
        self, state: _RequestState, out: EngineCoreOutput, stopped: list[str]
    ) -> CompletionOutput | None:
        """The sequence's completion after this update, as its output kind reports it; None for
        a FINAL_ONLY request that is still running."""
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        detokenizer = state.detokenizer
        # Tokens of this update past a stop string (speculative decoding emits several per step):
        # the history holds them, the output does not.
        num_cut = 0
        delta = ""
        if state.defer_text:
            if out.finished and detokenizer is not None:
                # No stop string can cut it: the whole output at once gives the same text.
                state.text = detokenizer.append(state.history.output_token_ids, finished=True)
        elif detokenizer is not None and (out.new_token_ids or out.finished):
            new_token_ids = out.new_token_ids
            if len(new_token_ids) > 1 and detokenizer.has_stop_strings:
                delta = ""
                for taken, token_id in enumerate(new_token_ids, 1):
                    last = taken == len(new_token_ids)
                    delta += detokenizer.append((token_id,), finished=out.finished and last)
                    if detokenizer.stop_reason is not None:
                        num_cut = len(new_token_ids) - taken
                        break
            else:
                # finished=True releases text held back while it could still start a stop string.
                delta = detokenizer.append(new_token_ids, finished=out.finished)
            if delta and state.output_kind is not DELTA:
                state.text += delta
            if detokenizer.stop_reason is not None:
                finish_reason, stop_reason = "stop", detokenizer.stop_reason
                if not out.finished:
                    stopped.append(out.request_id)
                # else: finished in the core on the same token that completed a stop string:
                # the string wins (it is what the user sees).
        new_logprobs: SampleLogprobs | None = None
        if state.logprobs is not None and out.new_logprobs is not None:
            # _new_state sets both together when the request asks for logprobs.
            assert state.cumulative_logprob is not None
            new_logprobs = []
            for record in out.new_logprobs[: len(out.new_logprobs) - num_cut]:
                new_logprobs.append(self._logprob_dict(record))
                state.cumulative_logprob += record.logprob
            if state.output_kind is not DELTA:
                state.logprobs += new_logprobs
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = [
                None if r is None else self._logprob_dict(r) for r in out.prompt_logprobs
            ]
        kind = state.output_kind
        if kind is FINAL_ONLY and finish_reason is None:
            return None
        logprobs: SampleLogprobs | None = None
        tokens: Sequence[int]
        if kind is DELTA:  # this update's part
            text, tokens = delta, out.new_token_ids
            if state.logprobs is not None:
                logprobs = new_logprobs or []
        else:  # everything so far, as a snapshot: the output is immutable
            text, tokens = state.text, state.history.output_token_ids
            if state.logprobs is not None:
                logprobs = list(state.logprobs)
        return _build(
            CompletionOutput,
            index=state.index,
            text=text,
            token_ids=tuple(tokens[: len(tokens) - num_cut] if num_cut else tokens),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
            cumulative_logprob=state.cumulative_logprob,
        )

    def _parent_output(self, parent_id: str) -> RequestOutput:
        parent = self._parents[parent_id]
        finished = parent.num_finished == len(parent.child_ids)
        if finished:
            del self._parents[parent_id]
        prompt_logprobs = parent.prompt_logprobs
        if parent.changed is not None:  # DELTA: the completions this step changed; prompt logprobs once
            completions = tuple(parent.changed[i] for i in sorted(parent.changed))
            parent.changed.clear()
            parent.prompt_logprobs = None
        else:
            completions = tuple(parent.completions)
        return RequestOutput(
            request_id=parent_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
        )

    def _logprob_dict(self, record: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's shape: the chosen token first (with its own rank), then the top-N not already in."""
        entries = {record.token_id: Logprob(record.logprob, record.rank, self._decode(record.token_id))}
        for rank, (token_id, logprob) in enumerate(
            zip(record.top_token_ids, record.top_logprobs, strict=True), 1
        ):
            if token_id not in entries:
                entries[token_id] = Logprob(logprob, rank, self._decode(token_id))
        return entries

    def _decode(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
