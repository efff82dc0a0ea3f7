"""Errors in the API's own shape: OpenAI's {"error": {"message", "type", "param", "code"}}
everywhere, Anthropic's {"type": "error", "error": {"type", "message"}} under /v1/messages."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.errors import (
    EngineDeadError,
    EngineDrainingError,
    FieldError,
    PromptError,
    QueueFullError,
)

log = logging.getLogger("cellserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_supported_error",
    503: "service_unavailable",
    504: "timeout_error",
}


# Anthropic's error types (docs.anthropic.com, "Errors"); 503 (draining) reads as overloaded
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def engine_error(exc: Exception, prompt_param: str = "prompt") -> APIError:
    """What the engine refuses (scheduler/errors.py, scheduler/intake.check_request) as the
    client sees it; `prompt_param` names the prompt in the body."""
    if isinstance(exc, PromptError):
        return APIError(400, str(exc), param=prompt_param, code=exc.code)
    if isinstance(exc, FieldError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(429, "the server is busy: queue full", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDrainingError):
        return APIError(503, "the server is shutting down", code="draining")
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_dead")
    return APIError(400, str(exc))


class BodyTooLargeError(StarletteHTTPException):
    """Raised from the receive wrapper; an HTTPException so FastAPI's body parsing passes it on."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    err_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    fallback = "invalid_request_error" if status < 500 else "api_error"
    err_type = _ANTHROPIC_TYPES.get(status, fallback)
    return {"type": "error", "error": {"type": err_type, "message": message}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> JSONResponse:
    """The error in the shape of the API that `path` belongs to."""
    if is_anthropic_path(path):
        return JSONResponse(anthropic_error_body(status, message), status, headers=headers)
    return JSONResponse(error_body(status, message, param, code), status, headers=headers)


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    # pydantic adds the union member name ("str", "list[int]", ...) into loc; it is noise here
    parts = [p for p in parts if not p.startswith(("list[", "function-", "tagged-union["))]
    parts = [p for p in parts if p not in ("str", "int", "float", "bool")]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        path = request.url.path
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers, path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        code = None
        if exc.status_code == 404 and message == "Not Found":
            message = "route not found"
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            message = "the request body could not be decoded: send UTF-8 JSON"
            code = "invalid_json"
        headers = dict(exc.headers) if exc.headers else None
        return error_response(
            exc.status_code, message, code=code, headers=headers, path=request.url.path
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        path = request.url.path
        errors = exc.errors()
        if not errors:
            return error_response(400, "invalid request", path=path)
        first = errors[0]
        if first.get("type") == "json_invalid":
            return error_response(
                400, "request body is not valid JSON", code="invalid_json", path=path
            )
        param = _loc_to_param(tuple(first.get("loc", ())))
        message = str(first.get("msg", "invalid value"))
        if param:
            message = f"{param}: {message}"
        return error_response(400, message, param=param, code="invalid_value", path=path)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        message = f"internal server error: {type(exc).__name__}"
        return error_response(500, message, path=request.url.path)
