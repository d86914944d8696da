"""Every error the HTTP surface answers is OpenAI's envelope (``{"error": {"message", "type", "param", "code"}}``):
never FastAPI's ``{"detail": ...}`` or a 422, never a stack trace."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError, InvalidRequest, MethodNotAllowed, UnknownURL

log = logging.getLogger("tiergate")


def error_response(exc: GatewayError, headers: dict[str, str]) -> Response:
    """``headers`` go after ``exc``'s own."""
    return Response(exc.body(), exc.status, {**exc.headers, **headers}, media_type="application/json")


def install_error_handlers(app: FastAPI) -> None:
    """Starlette's 404 (``unknown_url``) and 405, FastAPI's parameter errors (400 ``invalid_value``, naming the
    parameter) and any unexpected exception (500), in OpenAI's envelope."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            err: GatewayError = UnknownURL(f"Unknown request URL: {request.method} {request.url.path}.")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"Method {request.method} is not allowed for {request.url.path}.")
        else:
            err = GatewayError(str(exc.detail))
            err.status = exc.status_code
        return error_response(err, dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        # a query or path parameter of the wrong type (e.g. ``input_items?limit=abc``): named, as OpenAI does
        first: dict[str, Any] = next(iter(exc.errors()), {})
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body")) or None
        what = first.get("msg", "invalid")
        return error_response(InvalidRequest(f"Invalid value for '{param}': {what}." if param else
                                             f"Invalid request: {what}.", param=param, code="invalid_value"), {})

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(GatewayError("The gateway had an internal error; it has been logged."), {})
