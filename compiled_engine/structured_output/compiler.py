"""Grammars compiled against the model's vocabulary: once per distinct constraint, off the step loop.

`GrammarCompilerPool.submit` parses the constraint on the caller's thread (a bad schema, regex or
grammar is an InvalidRequestError there and then) and returns a future of the compiled grammar,
shared by every request with an equal constraint. Compiling runs on one background thread, so the
step loop never waits for it: a request whose grammar is not ready stays in the scheduler's
waiting queue (core/scheduler.py) while other requests run.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from compiled_engine.errors import InvalidRequestError
from compiled_engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

    from compiled_engine.structured_output.request_grammar import RequestGrammar

# Compiled grammars kept for reuse (least recently used dropped first). A compiled JSON-schema
# grammar holds an adaptive token mask cache of tens to hundreds of KiB.
MAX_CACHED_GRAMMARS = 256


class GrammarCompilerPool:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        """`vocab_size` is the logits' width (the model's), which may exceed the tokenizer's."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # built by the first job (vocab scan)
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple[str, str, bool], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compiler")
        self.num_compiles = 0  # for tests and stats: distinct constraints compiled

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `params`, now or later; InvalidRequestError if it has none."""
        if self._tokenizer is None:
            raise InvalidRequestError(
                "structured outputs need the model's tokenizer, and this model has none"
            )
        key = params.key
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
        # xgrammar is imported on first use: it takes seconds, and most engines never need it.
        from compiled_engine.structured_output.constraint import build_grammar

        grammar = build_grammar(params)  # outside the lock: parsing a large schema takes a while
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                future = self._pool.submit(self._compile, grammar)
                self._futures[key] = future
                self.num_compiles += 1
                while len(self._futures) > MAX_CACHED_GRAMMARS:
                    self._futures.popitem(last=False)  # requests holding it keep their future
            return future

    def request_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A new request's own matcher state over the (shared) compiled grammar of `params`."""
        from compiled_engine.structured_output.request_grammar import RequestGrammar

        return RequestGrammar(self.submit(params), self.vocab_size, self._eos_token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos_token_ids
            )
            # Two threads at most: the steps need the cores more than the compiler does.
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler.compile_grammar(grammar)
