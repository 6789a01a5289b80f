"""`EngineStats`: what `LLM.stats()` reports — load, KV cache, prefix cache, waste and the step timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from compiled_engine.records.graph_status import GraphStatus, GraphWait


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int
    # Tokens sampled for a request that had already ended (async loop: the step after a stop).
    num_discarded_tokens: int
    async_scheduling: bool
    # Step timeline, seconds summed over the engine's life:
    num_steps: int
    schedule_s: float  # host: scheduler.schedule()
    prepare_s: float  # host: staging inputs for the device
    execute_s: float  # the steps' work (CPU: compute; CUDA: the host's launch of it)
    wait_s: float  # host blocked on a step's sampled tokens
    update_s: float  # host: applying sampled tokens (appends, stop checks, frees)
    step_wall_s: float  # wall time inside the engine core's step()
    # Prefix cache. Tokens over the engine's life: known tokens of every admitted request (a
    # recompute after preemption counts again) and how many of them came from cached blocks.
    prefix_caching: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Blocks now: registered in the cache (in use or not), and of those, the free ones (counted in
    # num_free_kv_blocks too: they are evicted when a new block is needed).
    num_cached_kv_blocks: int
    num_evictable_kv_blocks: int
    # Compiled graphs: how many are ready, compiling, failed (records/graph_status.py); steps that
    # waited on the request path for a compile or load (each with its step number and seconds),
    # and steps run on a fallback graph while theirs compiled in the background.
    graphs: GraphStatus = field(default_factory=GraphStatus)
    graph_waits: tuple[GraphWait, ...] = ()
    num_fallback_steps: int = 0
    # Speculative decoding (docs/speculative_decoding.md), over the engine's life: request-steps
    # that verified proposals, the proposed tokens, and the accepted ones.
    speculative: bool = False
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Share of proposed tokens the target kept (0.0 before any proposal)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a request emits per step with proposals: the kept ones plus the target's own
        (1.0 would be no gain; 0.0 before any such step)."""
        if not self.num_spec_steps:
            return 0.0
        return (self.num_accepted_draft_tokens + self.num_spec_steps) / self.num_spec_steps

    @property
    def longest_graph_wait_s(self) -> float:
        return max((wait.seconds for wait in self.graph_waits), default=0.0)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of the queried tokens served from the prefix cache (0.0 before any query)."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def device_idle_fraction(self) -> float:
        """Share of the loop's wall time the device had no step to run (CPU execution only)."""
        if self.step_wall_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.execute_s / self.step_wall_s)
