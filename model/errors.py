from __future__ import annotations


class ModelLoadError(Exception):
    """A model file or folder cannot be served; the message is one sentence naming it."""
