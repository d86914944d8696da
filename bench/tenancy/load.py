"""The load of one run: the well-behaved keys (interactive, batch, agent) and the hostile key's older tricks, each
worker drawing its key's next request at random until the run's deadline or request count (the package's docstring
says what each does)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from bench.tenancy.common import SHARE
from bench.tenancy.tricks import HostileTricks

TRICKS = ("double_slash", "leave_early", "stream_no_usage", "their_response", "their_file", "fails_everywhere",
          "big_body", "legacy_over", "metrics", "plain", "unreadable_batch", "too_deep")


class Soak(HostileTricks):
    """The load of one run (module docstring)."""

    async def interactive(self, s: aiohttp.ClientSession) -> None:
        model = self.rng.choice(("gpt-5.6-sol-fast", "gpt-5.6"))
        status, raw = await self._post(s, "interactive", "/v1/chat/completions", {
            "model": model, "stream": True, "max_tokens": 120,
            "messages": [{"role": "user", "content": "[[emulate tokens=100 tps=2000 ttft_ms=20]] help me"}]})
        self._seen("interactive", status, raw)
        if self.rng.random() < 0.05 and len(self.tally.files) < 50 and (made := await self._upload(s, "interactive")):
            self.tally.files.append(made)

    async def batch(self, s: aiohttp.ClientSession) -> None:
        status, raw = await self._post(s, "batch", "/v1/chat/completions", {
            "model": "gpt-5.6", "max_tokens": 60,
            "messages": [{"role": "user", "content": "[[emulate tokens=50 tps=5000 ttft_ms=10]] summarise"}]})
        self._seen("batch", status, raw)

    async def agent(self, s: aiohttp.ClientSession, state: dict[str, str]) -> None:
        body: dict[str, Any] = {"model": "gpt-5.6-sol-fast", "input": "next step", "max_output_tokens": 40}
        if "last" in state:
            body["previous_response_id"] = state["last"]
        status, raw = await self._post(s, "agent", "/v1/responses", body)
        self._seen("agent", status, raw)
        if status == 200:
            state["last"] = json.loads(raw)["id"]
            self.tally.responses.append(state["last"])
            if len(self.tally.responses) > 200:
                self.tally.responses.pop(0)
            if self.rng.random() < 0.1:
                state.pop("last")  # a new run

    async def hostile(self, s: aiohttp.ClientSession) -> None:
        trick = self.rng.choice(TRICKS)
        status, right, raw = await getattr(self, f"_{trick}")(s)
        if status == 0 and right:  # nothing to go after yet (no response or file of another key)
            await asyncio.sleep(0)
            return
        self.tally.answer("hostile", status, raw, trick)
        if not right:
            self.tally.miss(f"hostile:{trick}", f"status {status}: {raw[:300]!r}")

    # the hostile key's tricks: (status, right?, what came back)

    async def _double_slash(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1//chat/completions", {
            "model": "gpt-5.6", "max_tokens": 50_000, "messages": [{"role": "user", "content": "x"}]})
        return status, status == 404, raw

    async def _leave_early(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1/chat/completions", {
            "model": "gpt-5.6-sol-fast", "stream": True,
            "messages": [{"role": "user", "content": "[[emulate tokens=3000 tps=20000]] go"}]}, read=2000)
        return status, status in (200, 429), raw

    async def _stream_no_usage(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        """Legacy completions streamed through the passthrough, no ``max_tokens``, no usage: all 2,000 events
        arrive (or a 429), and the key is charged them (the per-minute figures show it)."""
        status, raw = await self._post(s, "hostile", "/v1/completions", {
            "model": "gpt-5.6", "stream": True, "prompt": "[[emulate tokens=2000 tps=20000]] go on"})
        whole = raw.count(b'data: {"id"') == 2000 and raw.endswith(b"data: [DONE]\n\n")
        return status, (status == 200 and whole) or status == 429, raw[-300:]

    async def _their_response(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        if not self.tally.responses:
            return 0, True, b""
        rid = self.rng.choice(self.tally.responses)
        how = self.rng.choice(("get", "continue", "delete"))
        if how == "continue":
            status, raw = await self._post(s, "hostile", "/v1/responses", {
                "model": "gpt-5.6-sol-fast", "input": "what did they say?", "previous_response_id": rid})
            return status, status in (400, 429) and b"secret" not in raw, raw
        method = s.get if how == "get" else s.delete
        async with method(self.base + f"/v1/responses/{rid}", headers=self._h("hostile")) as resp:
            raw = await resp.read()
            return resp.status, resp.status in (404, 429), raw

    async def _their_file(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        if not self.tally.files or self.rng.random() < 0.3:
            async with s.get(self.base + "/v1/files", headers=self._h("hostile")) as resp:
                raw = await resp.read()
                theirs = any(f.encode() in raw for f in self.tally.files)
                return resp.status, resp.status in (200, 429) and not theirs, raw
        fid = self.rng.choice(self.tally.files)
        async with s.get(self.base + f"/v1/files/{fid}/content", headers=self._h("hostile")) as resp:
            raw = await resp.read()
            return resp.status, resp.status in (404, 429), raw

    async def _fails_everywhere(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1/chat/completions", {
            "model": "gpt-5.6", "max_tokens": 10,
            "messages": [{"role": "user", "content": "[[emulate status=500]] \\ud800"}]})
        return status, status in (500, 429, 503), raw  # its own 500 (or its own rest): never the others'

    async def _big_body(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1/chat/completions", {
            "model": "gpt-5.6", "max_tokens": 8, "messages": [{"role": "user", "content": "y" * 2**20}]})
        return status, status in (200, 429), raw

    async def _legacy_over(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1/completions", {
            "model": "gpt-5.6", "prompt": "x", "max_tokens": 50_000})
        return status, status == 429, raw

    async def _metrics(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        async with s.get(self.base + "/metrics", headers=self._h("hostile")) as resp:
            raw = await resp.read()
            return resp.status, resp.status == 401 and b"tiergate_key_" not in raw, raw

    async def _plain(self, s: aiohttp.ClientSession) -> tuple[int, bool, bytes]:
        status, raw = await self._post(s, "hostile", "/v1/chat/completions", {
            "model": "gpt-5.6-sol-fast", "max_tokens": 50,
            "messages": [{"role": "user", "content": "[[emulate tokens=40]] hi"}]})
        return status, status in (200, 429), raw

    async def run(self, workers: int, seconds: float, max_requests: int) -> None:
        deadline = time.monotonic() + seconds
        # the keys in turn (3 interactive, 2 batch, 2 agent, 3 hostile of every 10): from 4 workers up each has one
        names = [n for turn in range(max(SHARE.values())) for n, share in SHARE.items() if share > turn]
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            await self.setup(s)

            async def worker(i: int) -> None:
                name, state = names[i % len(names)], {}  # type: ignore[var-annotated]
                while time.monotonic() < deadline and sum(self.tally.sent.values()) < max_requests:
                    try:
                        if name == "agent":
                            await self.agent(s, state)
                        else:
                            await getattr(self, name)(s)
                    except (TimeoutError, aiohttp.ClientError) as exc:
                        self.tally.miss(f"{name}:transport", repr(exc))
            await asyncio.gather(*(worker(i) for i in range(workers)))
