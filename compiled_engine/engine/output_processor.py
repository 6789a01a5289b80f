"""Turns token-level engine-core outputs into text-level `RequestOutput`s.

Owns one incremental detokenizer per live request; finds stop strings (which may span token
boundaries) and reports the requests they end, so the engine can stop them in the core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from compiled_engine.core.engine_core_output import EngineCoreOutput
from compiled_engine.engine.detokenizer import IncrementalDetokenizer
from compiled_engine.outputs import CompletionOutput, RequestOutput
from compiled_engine.sampling_params import SamplingParams


@dataclass
class _RequestState:
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""


@dataclass(frozen=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Requests a stop string ended here; the core must stop scheduling them.
    stopped_by_string: list[str]


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: tuple[int, ...], params: SamplingParams
    ) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), stop=params.stop)
        self._states[request_id] = _RequestState(prompt, prompt_token_ids, detok)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        results: list[RequestOutput] = []
        stopped: list[str] = []
        for out in core_outputs:
            state = self._states.get(out.request_id)
            if state is None:  # aborted or already ended by a stop string
                continue
            state.token_ids.extend(out.new_token_ids)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if state.detokenizer is not None and (out.new_token_ids or out.finished):
                # finished=True releases text held back while it could still start a stop string.
                state.text += state.detokenizer.append(list(out.new_token_ids), finished=out.finished)
                if state.detokenizer.stopped and not out.finished:
                    finish_reason, stop_reason = "stop", state.detokenizer.stop_reason
                    stopped.append(out.request_id)
                elif state.detokenizer.stopped:
                    # Finished in the core on the same token that completed a stop string:
                    # the string wins (it is what the user sees).
                    finish_reason, stop_reason = "stop", state.detokenizer.stop_reason
            finished = finish_reason is not None
            completion = CompletionOutput(
                index=0,
                text=state.text,
                token_ids=tuple(state.token_ids),
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
            results.append(
                RequestOutput(
                    request_id=out.request_id,
                    prompt=state.prompt,
                    prompt_token_ids=state.prompt_token_ids,
                    outputs=(completion,),
                    finished=finished,
                )
            )
            if finished:
                del self._states[out.request_id]
        return ProcessedOutputs(results, stopped)
