"""What `LLM.embed` returns (vLLM's `EmbeddingRequestOutput` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float] = field(hash=False)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int] = field(hash=False)
    finished: bool = True
