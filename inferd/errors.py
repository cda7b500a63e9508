"""Every error inferd raises on purpose, in one place.

`InferdError` and its subclasses are caused by input or configuration: each message says what to change,
and the server answers them with a 4xx. `ServingError` and its subclasses are not the request's fault:
the server cannot take it now (503 with Retry-After) or could not finish it (a 5xx or an SSE error event).

`error_body` builds the OpenAI error body, the one builder behind every error the server, the gateway, the
Ray ingress and the disaggregation proxy send; `error_event` carries it in a stream that already began.
"""

import json


class InferdError(Exception):
    """Base class for every error caused by input or configuration."""

    #: the request field at fault, when there is one (OpenAI's error body carries it as `param`)
    param: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class InvalidRequestError(InferdError):
    """A request (prompt or sampling parameters) that can never be served as given."""


class ModelNotFoundError(InvalidRequestError):
    """A request names a model (or LoRA adapter) this server does not serve: a 404 `model_not_found`."""

    def __init__(self, message: str, param: str | None = "model"):
        super().__init__(message, param)


class ModelLoadError(InferdError):
    """A model that cannot be found, read or is of an architecture inferd does not have."""


class ConfigError(InferdError):
    """Engine settings that do not work together."""


class ServingError(Exception):
    """A request the server cannot serve now, or could not finish, through no fault of the request."""


class EngineOverloadedError(ServingError):
    """The waiting queue is full (or the server is draining): try again later."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(ServingError):
    """The step loop failed and could not recover; requests fail with this."""


class RequestFailedError(ServingError):
    """A step raised while this request was in the batch; the request was aborted."""


class DrainTimeoutError(ServingError):
    """The server is shutting down and this request outlived --drain-timeout."""


def clean(text: str | None) -> str | None:
    """`text` as valid UTF-8: lone surrogates (which JSON can carry but UTF-8 cannot) become escapes."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`; building it never raises,
    whatever the client sent (every string is made valid UTF-8)."""
    return {"error": {"message": clean(message), "type": type, "param": clean(param), "code": clean(code)}}


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status: the request's fault below 500, the server's from 500 on."""
    return "invalid_request_error" if status < 500 else "server_error"


def error_event(body: dict) -> str:
    """An error body as one SSE event, for a stream that already began (as vLLM and OpenAI send it)."""
    return f"data: {json.dumps(body)}\n\n"
