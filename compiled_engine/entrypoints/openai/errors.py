"""Errors in OpenAI's wire format: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `OpenAIError` (or one of its named cases) and the app turns it into a JSON response
with the matching status, so every failure a client sees has the shape the `openai` client parses.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

from compiled_engine.entrypoints.openai.protocol import ErrorInfo, ErrorResponse


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type=self.type, param=self.param, code=self.code)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def not_supported(param: str, detail: str = "") -> OpenAIError:
    suffix = f": {detail}" if detail else ""
    return bad_request(f"'{param}' is not supported by this server{suffix}", param=param, code="unsupported")


class BodyTooLargeError(OpenAIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the request body is larger than the server's limit of {limit} bytes",
            code="request_too_large",
        )


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=int(status))


def error_json(message: str, *, type: str, code: str | None = None) -> str:
    """The same body as a string, for an error that happens mid-stream (sent as an SSE event)."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=None, code=code)).model_dump_json()
