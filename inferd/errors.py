"""Errors a user can cause. Each message says what to change."""


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
