"""Which headers cross the gateway, each way. Upstream they are built, never copied, so no client credential, cookie or
hop-by-hop header crosses; back to the client they pass an allowlist, plus a passthrough answer's entity headers."""

from __future__ import annotations

import re
from collections.abc import Mapping

from gateway import __version__

RESPONSE_HEADER_ALLOW = ("openai-processing-ms", "retry-after", "retry-after-ms", "x-should-retry")


RESPONSE_HEADER_PREFIX_ALLOW = ("x-ratelimit-",)


# a passthrough answer's own headers a client needs besides those: what its body is. Its bytes are relayed as they
# came (not decoded), so content-encoding and content-length stay true of them
ENTITY_HEADERS = (b"content-type", b"content-disposition", b"content-encoding", b"content-length", b"content-range",
                  b"accept-ranges", b"openai-version")


# the client headers a passthrough request carries upstream (what its body is, what it accepts, the beta it opts
# into, its idempotency key); everything else (its key, cookies, hop-by-hop headers, organisation and project
# ids that belong to another account) stays behind
FORWARD_HEADERS = ("content-type", "content-length", "content-encoding", "accept", "openai-beta", "idempotency-key",
                   "range")


_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")  # RFC 9110 §5.5: no control character but tab


USER_AGENT = f"tiergate/{__version__}"


SKIP_FORWARDED = ("User-Agent", "Content-Type", "Accept")  # aiohttp adds none of these to a passthrough request


def field_value(value: str) -> bytes | None:
    """The bytes it came in (aiohttp decodes them UTF-8 with surrogate escapes); None when no valid field value (RFC
    9110 §5.5): such a header is dropped, never a broken answer."""
    data = value.encode("utf-8", "surrogateescape")
    return data if _FIELD_VALUE.fullmatch(data) else None


def forward_headers(client: Mapping[str, str], request_id: str) -> dict[str, str]:
    """``client``: lower-case names. The caller adds ``Authorization``."""
    out = {name: client[name] for name in FORWARD_HEADERS if name in client}
    out.update({"Accept-Encoding": "identity", "User-Agent": USER_AGENT, "X-Client-Request-Id": request_id})
    return out


def pass_headers(headers: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if low in RESPONSE_HEADER_ALLOW or low.startswith(RESPONSE_HEADER_PREFIX_ALLOW):
            out[low] = value
    return out
