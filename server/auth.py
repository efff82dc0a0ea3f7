"""API-key check: `Authorization: Bearer <key>` (OpenAI) or `x-api-key: <key>` (Anthropic)."""

from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import APIError


def check_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless the request carries the configured key (if any)."""
    expected = request.app.state.settings.api_key
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        token = request.headers.get("x-api-key", "")
    if not token:
        raise APIError(
            401,
            "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            code="no_key",
        )
    if not hmac.compare_digest(token.strip().encode(), expected.get_secret_value().encode()):
        raise APIError(401, "incorrect API key", code="invalid_api_key")
