"""The gateway's error tree: every class knows its HTTP status and its OpenAI error body. Statuses and ``type``/``code``
strings follow OpenAI's error guide and docs/reference/wire.md#errors-the-gateway-answers-itself, so that the ``openai``
SDK raises the matching exception class. The first paragraph of each class's docstring is its row of the generated table
on docs/errors.md#classes: write it for a reader of the docs.

:func:`upstream_error` and :func:`event_error` turn whatever an upstream sent as an error, an error body or an error
event inside a 200 stream, into an :class:`UpstreamStatusError` in OpenAI's shape."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import orjson


class GatewayError(Exception):
    """Base of every error the gateway answers with.

    ``headers``: extra response headers (``retry-after``), names lower-case."""

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
        return error_body(self.message, self.error_type, self.param, self.code)


class ConfigError(GatewayError):
    """A config file or environment problem found at start-up; the message names file, field and problem."""


class InvalidRequest(GatewayError):
    """400: the client's request cannot be read (bad JSON, missing or mistyped field)."""

    status = 400
    error_type = "invalid_request_error"
    code: str | None = "invalid_request"


class NoToolCall(InvalidRequest):
    """400, no code: a Responses tool output (``function_call_output``, ``custom_tool_call_output``) answers no tool
    call in the input or in the conversation it continues, as OpenAI answers it."""

    code = None


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


class ResponseNotFound(GatewayError):
    """404 for a Responses API id the gateway does not hold (``GET`` / ``DELETE /v1/responses/{id}``)."""

    status = 404
    error_type = "invalid_request_error"
    code = "response_not_found"


class SessionNotFound(GatewayError):
    """404: no agent session of the caller's gateway key has this id (another key's is not found either)."""

    status = 404
    error_type = "invalid_request_error"
    code = "session_not_found"


class ObjectNotFound(GatewayError):
    """404 for an object of the rest of the API (a file, a batch, ...) the request's gateway key did not make
    (``gateway.tenancy.objects``), answered as OpenAI answers an id the project does not hold ("No such File
    object")."""

    status = 404
    error_type = "invalid_request_error"
    code = "object_not_found"


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


class EmptyStream(UpstreamBadResponse):
    """502: the upstream answered a stream request 200 with no event at all (what it means depends on the upstream:
    its dialect may know the cause, ``gateway.upstream.dialects``)."""


class UpstreamTimeout(GatewayError):
    """504: the upstream did not answer within its configured timeout."""

    status = 504
    error_type = "server_error"
    code = "upstream_timeout"


class UpstreamAuthFailed(GatewayError):
    """502: an upstream answered 401 or 403 to the gateway's own credential for it (OpenAI's error codes guide: 401
    "Invalid Authentication" / "Incorrect API key provided", 403 "Country, region, or territory not supported" and
    permission errors). The key the gateway holds for that upstream is wrong, revoked or lacks access: not the client's
    fault, so not the client's 401 (the SDK would raise ``AuthenticationError`` against a valid gateway key) and never
    the upstream's words, which may quote part of that key. The message names the upstream by its configured name only;
    the upstream's own status, code and message go to the log, keys masked."""

    status = 502
    error_type = "server_error"
    code = "upstream_auth_failed"

    def __init__(self, upstream: str, upstream_status: int, upstream_code: str | None) -> None:
        super().__init__(f"The upstream '{upstream}' refused the gateway's credential for it (HTTP {upstream_status}):"
                         " the gateway's operator must fix that key. Neither the request nor its API key is at fault.")
        self.upstream = upstream
        self.upstream_status = upstream_status
        self.upstream_code = upstream_code


class UpstreamsResting(GatewayError):
    """503: every candidate upstream is resting (circuit breaker open or 429 cooldown); ``retry-after`` says when."""

    status = 503
    error_type = "server_error"
    code = "upstreams_resting"


class RateLimited(GatewayError):
    """429: every candidate upstream is cooling down after a 429 of its own; ``retry-after`` says when."""

    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class Unauthorized(GatewayError):
    """401: ``auth:`` is configured and the request carries no gateway key, or one the gateway does not know (OpenAI's
    answer to a wrong API key: the SDK raises ``AuthenticationError``)."""

    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # missing | malformed | unknown: the tiergate_auth_failures_total label


class KeyNotAllowed(GatewayError):
    """403: the request's gateway key may not use any tier that serves its model (the SDK raises
    ``PermissionDeniedError``)."""

    status = 403
    error_type = "invalid_request_error"
    code = "tier_not_allowed"


class KeyOverBudget(GatewayError):
    """429 ``insufficient_quota``: the gateway key spent its budget for the day or month (waiting seconds does not
    help: ``x-should-retry: false``)."""

    status = 429
    error_type = "insufficient_quota"
    code = "insufficient_quota"


class SessionBudgetExceeded(GatewayError):
    """429 ``session_budget_exceeded``: the agent session this request is a step of has spent a budget of its run
    (``param`` names it: ``max_steps``, ``max_usd`` or ``deadline``); nothing was sent upstream. Retrying the same run
    does not help (``x-should-retry: false``): a new run is a new session."""

    status = 429
    error_type = "insufficient_quota"
    code = "session_budget_exceeded"


class GatewayBusy(GatewayError):
    """503: the gateway holds as many request body bytes as it may (``limits.max_bytes_in_flight``); retry shortly."""

    status = 503
    error_type = "server_error"
    code = "gateway_busy"


class GatewayDraining(GatewayError):
    """503: the gateway is shutting down and its drain time ran out before this request was answered."""

    status = 503
    error_type = "server_error"
    code = "gateway_draining"


class StreamInterrupted(Exception):
    """The upstream body ended abnormally after its status line (raised by the upstream client, read by the relay).

    ``code``: ``upstream_stream_interrupted`` (reset, EOF inside a chunk) or ``upstream_idle_timeout``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class UpstreamStatusError(GatewayError):
    """The upstream's own error status, relayed before the first byte with its body in OpenAI's envelope.

    ``quota_exhausted``: a 429 that waiting does not fix (billing or credit exhausted); ``context_overflow``: whatever
    status the upstream chose for it; ``credential_refused``: a 401 or 403, which ``gateway.upstream.attempt.Attempt``
    makes an :class:`UpstreamAuthFailed` unless the key refused was the client's own."""

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

    @property
    def quota_exhausted(self) -> bool:
        return self.status == 429 and (self.error_type in _EXHAUSTED_NAMES or self.code in _EXHAUSTED_NAMES
                                       or _EXHAUSTED_TEXT.search(self.message) is not None)

    @property
    def context_overflow(self) -> bool:
        return self.code == "context_length_exceeded"

    @property
    def credential_refused(self) -> bool:
        return self.status in (401, 403)


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> bytes:
    """All four keys are always present (OpenAPI ``Error`` requires them). A message quoting the client's text may hold
    a lone surrogate, valid in JSON text but not encodable as UTF-8: it is escaped as ``\\uXXXX`` then."""
    envelope = {"error": {"message": message, "type": error_type, "param": param, "code": code}}
    try:
        return orjson.dumps(envelope)
    except TypeError:
        return json.dumps(envelope, ensure_ascii=True, separators=(",", ":")).encode()


# OpenAI's error guide: a 429 "You exceeded your current quota, please check your plan and billing details" is
# not fixed by waiting, unlike a rate limit; INSPECT-5340 and CODEX-6340 (docs/reference/wire.md#errors-and-retries)
# show the names.
_EXHAUSTED_NAMES = frozenset({"insufficient_quota", "billing_hard_limit_reached", "billing_not_active",
                              "credit_balance_exhausted", "quota_exhausted"})
_EXHAUSTED_TEXT = re.compile(r"(?i)exceeded your current quota|billing|credit balance|insufficient[_ ]quota")
# The prompt does not fit: OpenAI's code and wording, vLLM's, llama.cpp's ("exceeds the available context size",
# sent as a 500), Anthropic-style ("prompt is too long"). Never matched on a 429, whose "too many tokens" is a rate.
_OVERFLOW_TEXT = re.compile(r"(?i)context[_ ](?:length|size|window)|maximum context|prompt is too long|"
                            r"too many (?:input|prompt) tokens")
# text-generation-inference's error_type names, by the status its HTTP server answers them with (its router's docs)
_TGI_STATUS = {"validation": 422, "overloaded": 429, "generation": 424, "incomplete_generation": 500, "tokenizer": 422}
# An error event carries no HTTP status: read it from the error itself (vLLM and llama.cpp put the status in an
# integer ``code``, Groq in ``status_code``), else from its type or code name.
_STATUS_BY_NAME = {"invalid_request_error": 400, "context_length_exceeded": 400, "authentication_error": 401,
                   "invalid_api_key": 401, "permission_error": 403, "not_found_error": 404, "model_not_found": 404,
                   "rate_limit_error": 429, "rate_limit_exceeded": 429, "insufficient_quota": 429,
                   "overloaded_error": 503, "server_error": 500, "api_error": 500, "internal_error": 500}


def upstream_error(status: int, body: bytes, headers: Mapping[str, str]) -> UpstreamStatusError:
    """Whatever its shape: OpenAI's, flat bodies (Cerebras, older vLLM), an integer ``code``, ``""`` for null (Cerebras'
    ``"param": ""``), no string ``message`` (the upstream's own words are kept), non-JSON text. A prompt over the
    context window becomes 400 ``context_length_exceeded`` whatever status the upstream chose, a 429 aside (vLLM and
    llama.cpp's ``llama-server`` answer 400, ``llama-cpp-python`` and older vLLM 500)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    data = parsed.get("error", parsed) if isinstance(parsed, dict) else None
    if isinstance(data, str):  # text-generation-inference, older vLLM: {"error": "text", "error_type": "validation"}
        kind = parsed.get("error_type") if isinstance(parsed, dict) else None
        data = {"message": data, "type": kind if isinstance(kind, str) and kind else None}
    text = body.decode("utf-8", "replace").strip()[:2000]
    if not isinstance(data, dict):
        data = {"message": text or f"Upstream answered HTTP {status}."}
    elif not _text(data.get("message")):
        detail = data.get("detail", parsed.get("detail") if isinstance(parsed, dict) else None)
        data = {**data, "message": _text(detail) or (orjson.dumps(detail).decode() if detail else text)}
    return _normalise(status, data, headers)


def event_error(event: dict[str, Any]) -> UpstreamStatusError:
    """For an error before the first byte, with the HTTP status the event names
    (docs/reference/wire.md#errors-inside-a-stream, docs/reference/wire.md#responses-api-streams): an integer
    ``code``/``status_code``/``status`` in 400-599 inside the error, else beside it (Cerebras), else by its type or code
    name, else 500."""
    data: Any = event.get("error")
    if isinstance(data, str):  # text-generation-inference, older vLLM: {"error": "text", "error_type": "validation"}
        kind = event.get("error_type")
        data = {"message": data, "type": kind, "status_code": _TGI_STATUS.get(kind) if isinstance(kind, str) else None}
    if not isinstance(data, dict):
        response = event.get("response")
        failed = response.get("error") if isinstance(response, dict) else None
        data = failed if isinstance(failed, dict) else (event if event.get("type") == "error" else {})
    # the status inside the error, else beside it (Cerebras: {"error": {...}, "status_code": 429})
    status = next((v for holder in (data, event) for k in ("status_code", "status", "code")
                   if _is_status(v := holder.get(k))), None)
    if status is None:
        status = next((_STATUS_BY_NAME[n] for n in (data.get("code"), data.get("type"))
                       if isinstance(n, str) and n in _STATUS_BY_NAME), 500)  # an upstream may send objects there
    if not _text(data.get("message")):
        data = {**data, "message": "The upstream sent an error event: " + orjson.dumps(data).decode()[:2000]}
    return _normalise(status, data, {})


def _normalise(status: int, data: dict[str, Any], headers: Mapping[str, str]) -> UpstreamStatusError:
    message = data.get("message")
    etype, code, param = _text(data.get("type")), data.get("code"), _text(data.get("param"))
    code = str(code) if isinstance(code, int) and not isinstance(code, bool) else _text(code)
    message = message if isinstance(message, str) else orjson.dumps(message).decode()
    if status != 429 and _OVERFLOW_TEXT.search(f"{code} {message}"):
        return UpstreamStatusError(400, message, error_type="invalid_request_error", param=param or "messages",
                                   code="context_length_exceeded", headers=headers)
    return UpstreamStatusError(status, message, error_type=etype or _type_for(status), param=param, code=code,
                               headers=headers)


def _text(value: object) -> str | None:
    """Upstreams send ``""`` for "none"."""
    return value if isinstance(value, str) and value else None


def _is_status(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 400 <= value <= 599


def _type_for(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status in (401, 403):
        return "authentication_error" if status == 401 else "permission_error"
    return "server_error" if status >= 500 else "invalid_request_error"
