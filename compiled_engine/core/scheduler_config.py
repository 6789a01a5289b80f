"""Limits the scheduler works within, fixed for the engine's lifetime."""

from __future__ import annotations

from dataclasses import dataclass

from compiled_engine.speculative_config import SpeculativeConfig


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    # Most requests in the running set (decode batch size ceiling).
    max_num_seqs: int
    # Token budget of one step: prefill chunks plus one token per decoding request.
    max_num_batched_tokens: int
    # Longest sequence (prompt + outputs) a request may reach.
    max_model_len: int
    block_size: int = 16
    num_kv_blocks: int
    # Steps that may be scheduled before the oldest one is updated: 1 for the synchronous loop,
    # 2 for the async loop (step N+1 is scheduled while step N runs).
    max_in_flight_steps: int = 1
    # Automatic prefix caching: computed full blocks are kept (until evicted) and shared by
    # requests whose tokens start the same way (core/kv_cache_manager.py). The engine turns it on
    # by default (LLMEngine / LLM `enable_prefix_caching=True`); a bare SchedulerConfig leaves it
    # off, so scheduler tests that reuse one prompt across requests see no sharing.
    enable_prefix_caching: bool = False
    # Most prompt tokens one request computes per step (0: up to the step budget). vLLM's option
    # of this name: a long prompt then takes several short chunks, so the steps it shares with
    # decoding requests stay short (lower tail inter-token latency, longer time to first token).
    long_prefill_token_threshold: int = 0
    # The step sizes (token counts) the runner pads a step to (its compiled buckets; ascending;
    # empty: none). With a long-prefill threshold, a step that decodes takes only as many prompt
    # tokens as bring it to the largest of these within the threshold: the padding slots a
    # bucket would add are then not spent, and the step costs its bucket below (Scheduler
    # _prefill_room says when).
    step_token_buckets: tuple[int, ...] = ()
    # Pipeline parallelism's steps in flight (P, one per stage; 1: off). Stage 0 starts step N+1
    # while later stages run step N, so the scheduler hands out up to this many steps before the
    # oldest is updated (max_in_flight_steps must equal it), with two rules of its own: a request
    # whose token a step in flight is still sampling waits for it (no placeholder: stage 0 would
    # need the token before the last stage produced it), and each step takes at most 1/depth of
    # the requests there are, so the steps in flight hold different requests and stay about even.
    pipeline_depth: int = 1
    # Speculative decoding (None: off): decoding requests get proposed tokens to verify, within
    # the token budget, while at most `disable_by_batch_size` requests run.
    speculative: SpeculativeConfig | None = None
    # Multi-step scheduling (1: off): a step whose every row decodes one greedy token, with no
    # request waiting, runs up to this many decode steps back to back (each row's blocks allocated
    # for all of them); the runner feeds each step's tokens to the next and returns every row's run
    # (ModelRunnerOutput.step_token_ids), which update appends with the usual stop checks.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "num_kv_blocks",
            "max_in_flight_steps",
            "pipeline_depth",
            "num_scheduler_steps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        if self.num_scheduler_steps > 1 and (self.max_in_flight_steps > 1 or self.speculative is not None):
            raise ValueError(
                "SchedulerConfig.num_scheduler_steps > 1 needs the synchronous loop (max_in_flight_steps=1) "
                "and no speculative decoding"
            )
        if self.pipeline_depth > 1 and self.max_in_flight_steps != self.pipeline_depth:
            raise ValueError(
                f"SchedulerConfig.max_in_flight_steps must equal pipeline_depth={self.pipeline_depth} "
                f"(one step in flight per pipeline stage), got {self.max_in_flight_steps}"
            )
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(
                f"SchedulerConfig.long_prefill_token_threshold must be an int >= 0, got {threshold!r}"
            )
        buckets = self.step_token_buckets
        if (
            not isinstance(buckets, tuple)
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets)
            or list(buckets) != sorted(set(buckets))
        ):
            raise ValueError(
                f"SchedulerConfig.step_token_buckets must be a tuple of ascending distinct ints >= 1, "
                f"got {buckets!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"SchedulerConfig.enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(
                f"SchedulerConfig.speculative must be a SpeculativeConfig or None, got {self.speculative!r}"
            )

    @property
    def num_cache_tokens(self) -> int:
        """Tokens the whole KV cache can hold."""
        return self.num_kv_blocks * self.block_size
