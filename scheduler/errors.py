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
