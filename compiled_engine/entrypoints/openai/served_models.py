"""The names the server answers to (`--served-model-name`) and `/v1/models`."""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus

from compiled_engine.entrypoints.openai.errors import OpenAIError
from compiled_engine.entrypoints.openai.protocol import ModelCard, ModelList


class ServedModels:
    def __init__(self, names: Sequence[str], *, root: str, max_model_len: int) -> None:
        if not names:
            raise ValueError("at least one served model name is needed")
        self.names = list(names)
        self._root = root
        self._max_model_len = max_model_len

    @property
    def default(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The name to report for a request; a name this server does not serve is a 404."""
        if requested is None:
            return self.default  # as vLLM: a request without a model gets the served one
        if requested not in self.names:
            raise OpenAIError(
                HTTPStatus.NOT_FOUND,
                f"The model `{requested}` does not exist. This server serves: {', '.join(self.names)}",
                param="model",
                code="model_not_found",
            )
        return requested

    def model_list(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, root=self._root, max_model_len=self._max_model_len) for name in self.names
            ]
        )
