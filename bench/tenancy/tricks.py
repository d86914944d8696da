"""The hostile key's tricks against admission (issue 32), each drawn at random by its workers beside the older ones:
bodies the gateway cannot read that name another key's file on the passthrough, and objects nested past the depth
bound on every entrance (chat, Responses over HTTP, a WebSocket-mode message). Each returns (status, right?, what
came back); what is right is what tests/test_admission.py holds the gateway to."""

from __future__ import annotations

import json

import aiohttp

from bench.tenancy.common import Client

# a batch over another key's file, the body unreadable to the gateway (or readable two ways): how it is sent, and the
# one answer that is right. None: bob's own file named last after hers (the gateway keeps the last and forwards what
# it checked), served (200, naming only its own file) or refused by its limits (429)
UNREADABLE: dict[str, tuple[str | None, tuple[int, str] | None]] = {
    "no content type": (None, (415, "unsupported_media_type")),
    "text/plain": ("text/plain", (415, "unsupported_media_type")),
    "octet-stream": ("application/octet-stream", (415, "unsupported_media_type")),
    "NaN": ("application/json", (400, "invalid_json")),
    "1e400": ("application/json", (400, "invalid_json")),
    "byte order mark": ("application/json", (404, "object_not_found")),
    "duplicate, hers last": ("application/json", (404, "object_not_found")),
    "duplicate, own last": ("application/json", None),
}
DEPTH = 260  # past the gateway's bound, and past the 254 levels orjson writes (the 500 of defect 7)


def deep(levels: int = DEPTH) -> bytes:
    """A JSON object ``levels`` deep, as text."""
    return b'{"a":' * levels + b'"x"' + b"}" * levels


def unreadable_body(how: str, theirs: str, own: str) -> bytes:
    """The batch body of variant ``how`` of :data:`UNREADABLE`, naming file ``theirs`` (and ``own``)."""
    tail = b'"endpoint": "/v1/chat/completions", "completion_window": "24h"'
    plain = b'{"input_file_id": "%s", %s}' % (theirs.encode(), tail)
    return {
        "NaN": plain[:-1] + b', "x": NaN}',
        "1e400": plain[:-1] + b', "x": 1e400}',
        "byte order mark": b"\xef\xbb\xbf" + plain,
        "duplicate, hers last": b'{"input_file_id": "%s", "input_file_id": "%s", %s}' % (
            own.encode(), theirs.encode(), tail),
        "duplicate, own last": b'{"input_file_id": "%s", "input_file_id": "%s", %s}' % (
            theirs.encode(), own.encode(), tail),
    }.get(how, plain)


class HostileTricks(Client):
    """The tricks of this module, as the hostile key."""

    async def _upload(self, s: aiohttp.ClientSession, name: str) -> str | None:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", b'{"custom_id": "x"}\n', filename=f"{name}.jsonl")
        async with s.post(self.base + "/v1/files", data=form, headers=self._h(name)) as resp:
            made = await resp.json() if resp.status == 200 else {}
        return made["id"] if isinstance(made.get("id"), str) else None

    async def setup(self, s: aiohttp.ClientSession) -> None:
        """Before the load (and before the hostile key's limits bite): a file of the interactive key's and one of the
        hostile key's own, and the one batch that is served: both named, its own last (the gateway keeps the last
        and forwards what it checked: the upstream's list, read at the end, holds it naming the hostile's file)."""
        theirs, own = await self._upload(s, "interactive"), await self._upload(s, "hostile")
        if theirs is None or own is None:
            self.tally.miss("setup:files", f"uploads answered {theirs!r}, {own!r}")
            return
        self.tally.files.append(theirs)
        self.tally.own_files.append(own)
        got = await self._unreadable_batch(s, "duplicate, own last")
        self.tally.answer("hostile", got[0], got[2], "unreadable_batch")
        if not got[1] or got[0] != 200:
            self.tally.miss("hostile:unreadable_batch", f"the served batch: {got[0]} {got[2][:300]!r}")

    async def _unreadable_batch(self, s: aiohttp.ClientSession, how: str = "") -> tuple[int, bool, bytes]:
        """``POST /v1/batches`` over the interactive key's file, in a body the gateway cannot read (or reads another
        way than an upstream may): refused, never forwarded (the upstream's own list is read at the end)."""
        if not self.tally.files or not self.tally.own_files:
            return 0, True, b""
        how = how or self.rng.choice(tuple(UNREADABLE))
        ctype, right = UNREADABLE[how]
        body = unreadable_body(how, self.rng.choice(self.tally.files), self.tally.own_files[0])
        status, raw = await self._raw_post(s, "hostile", "/v1/batches", body, ctype)
        self.tally.trick_codes[f"unreadable_batch: {how}"][f"{status}"] += 1
        if right is not None:
            got = json.loads(raw).get("error", {}).get("code") if raw.startswith(b"{") else None
            return status, (status, got) == right, raw
        if status == 200:
            return status, json.loads(raw).get("input_file_id") == self.tally.own_files[0], raw
        return status, status == 429, raw

    async def _too_deep(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        """A message holding an object 260 deep, on chat (the Cerebras dialect wrote it again: a 500), Responses
        over HTTP, or a WebSocket-mode message: 400 ``invalid_json`` on each, nothing forwarded."""
        where = self.rng.choice(("chat", "responses", "websocket"))
        message = b'{"role": "user", "content": "hi", "extra": %s}' % deep()
        if where == "chat":
            status, raw = await self._post(s, "hostile", "/v1/chat/completions", b'{"model": "gpt-5.6-sol-fast", '
                                           b'"max_tokens": 5, "messages": [%s]}' % message)
        elif where == "responses":
            status, raw = await self._post(s, "hostile", "/v1/responses",
                                           b'{"model": "gpt-5.6-sol-fast", "input": [%s]}' % message)
        else:
            status, raw = await self._deep_socket(s, message)
        self.tally.trick_codes[f"too_deep: {where}"][f"{status}"] += 1
        return status, status == 400 and b'"invalid_json"' in raw, raw

    async def _deep_socket(self, s: aiohttp.ClientSession, message: bytes) -> tuple[int, bytes]:
        """The deep message as a ``response.create`` on a socket of its own: the error event's status and the event
        (a refused handshake: its status)."""
        url = self.base.replace("http://", "ws://") + "/v1/responses"
        create = b'{"type": "response.create", "model": "gpt-5.6-sol-fast", "input": [' + message + b"]}"
        try:
            async with s.ws_connect(url, headers=self._h("hostile"),
                                    timeout=aiohttp.ClientWSTimeout(ws_close=5)) as ws:
                await ws.send_str(create.decode())
                msg = await ws.receive(timeout=10)
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status, b""
        except TimeoutError:
            return 0, b"no event within 10 s"
        if msg.type != aiohttp.WSMsgType.TEXT:
            return 0, f"{msg.type!r} {msg.data!r} {msg.extra!r}".encode()
        event = json.loads(msg.data)
        return (int(event.get("status") or 0) if event.get("type") == "error" else 200), msg.data.encode()
