"""Every error inferd raises on purpose, in one place.

`InferdError` and its subclasses are caused by input or configuration: each message says what to change,
and the server answers them with a 4xx. `ServingError` and its subclasses are not the request's fault:
the server cannot take it now (503 with Retry-After) or could not finish it (a 5xx or an SSE error event).
"""


class InferdError(Exception):
    """Base class for every error caused by input or configuration."""

    #: the request field at fault, when there is one (OpenAI's error body carries it as `param`)
    param: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class InvalidRequestError(InferdError):
    """A request (prompt or sampling parameters) that can never be served as given."""


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
