"""The emulator's per-request directives: ``[[emulate key=value ...]]`` anywhere in the request body, so that they cross
the gateway untouched; the last one counts (a conversation's latest turn). Users' guide: docs/emulator.md#directives.

============  ==========================================================================
tokens        completion tokens to generate (default: the request's token limit, capped, else 48)
tps           tokens per second; ttft_ms: time to first token in milliseconds
per_chunk     tokens per SSE event (default 1)
usage         ``none``: report no usage at all
served_tier   the ``service_tier`` an OpenAI-dialect answer says it served (default: the one asked)
done          ``0``/``1``: end with ``data: [DONE]`` (default: the dialect's profile)
dialect       answer in this dialect's profile instead of the emulator's own
transcript    replay NAME.body from the fixtures folder (status and content-type from NAME.json)
status        answer this HTTP status with an OpenAI error body (``retry_after_ms`` adds the header)
drop_after    after N events, reset the connection; stall_after: after N events, go silent
fail_after    Responses API stream (native): after N output tokens, ``response.failed`` (``server_error``)
fault         one of :data:`gateway.tools.emulator.faults.FAULTS`
tool          ``call``: with tools, call one even after tool results (an agent loop); ``text``: answer in text
============  ==========================================================================
"""

from __future__ import annotations

import re

_DIRECTIVE = re.compile(rb"\[\[emulate ([^\]]*)\]\]")


def directives(raw: bytes) -> dict[str, str]:
    found = None
    for found in _DIRECTIVE.finditer(raw):  # noqa: B007 - the last match is the one that counts
        pass
    if found is None:
        return {}
    out = {}
    for part in found.group(1).decode().split():
        key, _, value = part.partition("=")
        out[key] = value
    return out
