"""Typed errors raised at the engine's boundary; the gateway maps them to HTTP statuses."""


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request or sampling parameter is invalid (HTTP 400). `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(EngineError, ValueError):
    """EngineConfig is inconsistent; the message says which setting to change."""


class ModelLoadError(EngineError):
    """The model directory is missing, corrupt or of an unsupported architecture."""


class EngineOverloadedError(EngineError):
    """The bounded waiting queue is full (HTTP 503 with Retry-After)."""


class EngineDeadError(EngineError):
    """The engine's step thread died; no request can be served until restart."""


class RequestFailedError(EngineError):
    """One request failed inside the engine; the engine keeps serving everyone else."""
