"""Errors the engine raises at submit; the server maps each to an HTTP status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class."""


class QueueFullError(EngineError):
    """The waiting queue is at max_queue (HTTP 429)."""


class EngineDrainingError(EngineError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


class EngineDeadError(EngineError):
    """The engine thread died; nothing can be served (HTTP 503)."""


class PromptError(ValueError):
    """The prompt cannot be served: empty, or past the context with context shift off (HTTP 400
    naming the prompt; `code` is OpenAI's error code when there is one)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class FieldError(ValueError):
    """A request field the engine cannot serve (HTTP 400 naming `param`, the API's field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param
