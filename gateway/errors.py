"""The gateway's error tree; every class knows its HTTP status and its OpenAI error body.

::

    GatewayError                     rendered as {"error": {"message", "type", "param", "code"}}
    ├── ConfigError                  start-up only: a bad config file or a missing key; never an HTTP answer
    ├── InvalidRequest               400 invalid_request_error (bad JSON, missing or mistyped field)
    │   ├── PayloadTooLarge          413
    │   └── UnsupportedMediaType     415
    ├── ModelNotFound                404 model_not_found
    ├── UnknownURL                   404 unknown_url
    ├── MethodNotAllowed             405 method_not_allowed
    ├── UpstreamUnavailable          502 upstream_unavailable (connect refused, reset before the status line)
    ├── UpstreamBadResponse          502 upstream_bad_response (a 200 that is not what the request asked for)
    ├── UpstreamTimeout              504 upstream_timeout
    ├── UpstreamsResting             503 upstreams_resting (every candidate's breaker open or in 429 cooldown)
    └── UpstreamStatusError          the upstream's own 4xx/5xx before the first byte, status kept

Status codes and ``type``/``code`` strings follow OpenAI's error guide and the table in
``shared/design/wire-contract.md`` §4, so that the ``openai`` SDK raises the matching exception class.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson


class GatewayError(Exception):
    """Base of every error the gateway answers with.

    Attributes:
        status: HTTP status code of the answer.
        error_type: OpenAI ``error.type``.
        code: OpenAI ``error.code`` (a short stable string) or None.
        param: the request field at fault, or None.
        headers: extra response headers (e.g. ``retry-after``), names lower-case.
    """

    status = 500
    error_type = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> bytes:
        """The OpenAI error envelope as compact JSON bytes."""
        return error_body(self.message, self.error_type, self.param, self.code)


class ConfigError(GatewayError):
    """A config file or environment problem found at start-up; the message names file, field and problem."""


class InvalidRequest(GatewayError):
    """400: the client's request cannot be read (bad JSON, missing or mistyped field)."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class PayloadTooLarge(InvalidRequest):
    """413: the request body is over ``limits.max_request_bytes``."""

    status = 413
    code = "request_too_large"


class UnsupportedMediaType(InvalidRequest):
    """415: the request body is not declared as JSON."""

    status = 415
    code = "unsupported_media_type"


class ModelNotFound(GatewayError):
    """404: no configured upstream serves the requested model (as OpenAI and Cerebras answer)."""

    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class UnknownURL(GatewayError):
    """404 for a path the gateway does not serve (OpenAI's ``unknown_url``)."""

    status = 404
    error_type = "invalid_request_error"
    code = "unknown_url"


class MethodNotAllowed(GatewayError):
    """405 for a known path with the wrong method."""

    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class UpstreamUnavailable(GatewayError):
    """502: no upstream could be reached (refused, reset or closed before the status line)."""

    status = 502
    error_type = "server_error"
    code = "upstream_unavailable"


class UpstreamBadResponse(GatewayError):
    """502: the upstream answered 200 with a body the request cannot use (e.g. not JSON)."""

    status = 502
    error_type = "server_error"
    code = "upstream_bad_response"


class UpstreamTimeout(GatewayError):
    """504: the upstream did not answer within its configured timeout."""

    status = 504
    error_type = "server_error"
    code = "upstream_timeout"


class UpstreamsResting(GatewayError):
    """503: every candidate upstream is resting (circuit breaker open or 429 cooldown); ``retry-after`` says when."""

    status = 503
    error_type = "server_error"
    code = "upstreams_resting"


class UpstreamStatusError(GatewayError):
    """The upstream's own error status, relayed before the first byte with its body in OpenAI's envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str,
        param: str | None,
        code: str | None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, param=param, headers=headers)
        self.status = status
        self.error_type = error_type
        self.code = code


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> bytes:
    """Render OpenAI's error envelope ``{"error": {"message", "type", "param", "code"}}`` as JSON bytes.

    All four keys are always present (OpenAPI ``Error`` requires them).
    """
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})
