"""What every part of the soak shares: the keys and their limits, the prices, the tally of what came back, a client
that records each answer, and the reading of the gateway's ``/metrics``."""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
PRICE = {"input": 10.0, "output": 30.0}  # USD per million tokens, default service tier
PRIORITY = {"input": 20.0, "output": 60.0}  # what the standard upstream sells `service_tier: priority` at
# the steps of a session burst: few tokens (max_steps bites), or many (max_usd bites first); the emulator answers
# exactly `tokens`, each step held in flight 0.5 s so that a burst's steps are all admitted at once
# (compact, as the gateway re-writes a body it checked: its estimate counts those bytes)
STEPS_BODY = json.dumps({"model": "gpt-5.6", "max_tokens": 2, "messages": [
    {"role": "user", "content": "[[emulate tokens=2 ttft_ms=500]] go on"}]}, separators=(",", ":")).encode()
USD_BODY = json.dumps({"model": "gpt-5.6", "max_tokens": 1000, "messages": [
    {"role": "user", "content": "[[emulate tokens=1000 tps=50000 ttft_ms=500]] go on"}]},
    separators=(",", ":")).encode()


def estimate(body: bytes, max_tokens: int) -> float:
    """USD: the gateway's estimate of one step (docs/sessions.md, "Steps in flight count"): the body's bytes / 4 at
    the input price, ``max_tokens`` at the output price. The emulator counts fewer prompt tokens (its messages' text
    / 4) and answers ``tokens`` = ``max_tokens``, so a step costs at most its estimate."""
    return math.ceil(len(body) / 4) * PRICE["input"] / 1e6 + max_tokens * PRICE["output"] / 1e6


MAX_STEPS = 3
MAX_USD = round(1.5 * estimate(USD_BODY, 1000), 6)  # two dollar-heavy steps admitted: at $0 and at one estimate
BUDGETS = {"max_steps": MAX_STEPS, "max_usd": MAX_USD}
LIMITS: dict[str, dict[str, Any]] = {
    "interactive": {"tokens_per_minute": 60_000, "usd_per_day": 1.0},
    "batch": {"requests_per_minute": 300},
    "agent": {},
    "hostile": {"tokens_per_minute": 20_000, "usd_per_day": 0.3},
    "tiered": {"requests_per_minute": 600},
    "runs": {},
    "pinned": {},
}
PINNED_RUN = "soak-pinned-run"
# what else each key is given in `auth.keys` (its tiers, its session: budgets per run, or one pinned run)
KEY_EXTRA: dict[str, dict[str, Any]] = {
    "batch": {"tiers": ["standard"]},
    "tiered": {"tiers": ["standard"]},
    "runs": {"session": {"pin": False, "budgets": BUDGETS}},
    "pinned": {"session": {"id": PINNED_RUN, "budgets": BUDGETS}},
}
SHARE = {"interactive": 3, "batch": 2, "agent": 2, "hostile": 3}  # of every 10 workers


@dataclass
class Tally:
    """What the soak saw, per key and per trick."""

    sent: Counter[str] = field(default_factory=Counter)
    codes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))  # "429 rate_limit_exceeded"
    tricks: Counter[str] = field(default_factory=Counter)
    trick_codes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    wrong: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    responses: list[str] = field(default_factory=list)  # ids the agent made
    files: list[str] = field(default_factory=list)  # ids the interactive key uploaded
    own_files: list[str] = field(default_factory=list)  # the hostile key's own file
    phases: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))  # figures per trick

    def answer(self, name: str, status: int, raw: bytes, trick: str | None = None) -> str:
        """Count one answer of key ``name`` (of ``trick``); returns its label (the status and error code)."""
        label = f"{status} {error_code(raw)}".rstrip()
        self.sent[name] += 1
        self.codes[name][label] += 1
        if trick is not None:
            self.tricks[trick] += 1
            self.trick_codes[trick][label] += 1
        return label

    def miss(self, what: str, why: str) -> None:
        self.wrong[what] += 1
        self.examples.setdefault(what, why[:300])


def error_code(raw: bytes) -> str:
    """The ``error.code`` of an OpenAI-shaped error body (or WebSocket error event), else ''."""
    if not raw.startswith(b"{") or b'"error"' not in raw[:4096]:
        return ""
    try:
        err = json.loads(raw).get("error")
    except ValueError:
        return ""
    return str(err.get("code") or "") if isinstance(err, dict) else ""


class Client:
    """The keys of one run and how to send as one of them."""

    def __init__(self, base: str, keys: dict[str, str], seed: int, tally: Tally) -> None:
        self.base, self.keys, self.tally = base, keys, tally
        self.rng = random.Random(seed)

    def _h(self, name: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[name]}"}

    async def _post(self, s: aiohttp.ClientSession, name: str, path: str, body: Any,
                    read: int | None = None) -> tuple[int, bytes]:
        """POST ``body`` as JSON; with ``read``, leave after that many content events of a stream."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with s.post(self.base + path, data=data, headers={**self._h(name), "content-type": "application/json"}
                          ) as resp:
            if read is None or resp.status != 200:
                return resp.status, await resp.read()
            seen = 0
            async for line in resp.content:
                if b'"content":"' in line:
                    seen += 1
                    if seen >= read:
                        break
            return resp.status, b""

    async def _raw_post(self, s: aiohttp.ClientSession, name: str, path: str, data: bytes,
                        ctype: str | None) -> tuple[int, bytes]:
        """POST ``data`` with exactly the content type given (None: no content-type header at all)."""
        headers = {**self._h(name), **({"content-type": ctype} if ctype else {})}
        async with s.post(self.base + path, data=data, headers=headers, skip_auto_headers=("Content-Type",)) as resp:
            return resp.status, await resp.read()

    def _seen(self, name: str, status: int, raw: bytes) -> None:
        self.tally.answer(name, status, raw)
        if status >= 500 or (status == 429 and name in ("agent",)):  # never the hostile key's doing
            self.tally.miss(f"{name}:{status}", raw.decode("utf-8", "replace"))


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of family ``name``'s samples in the exposition ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line.split("}", 1)[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def scrape(s: aiohttp.ClientSession, base: str, token: str) -> str:
    async with s.get(base + "/metrics", headers={"authorization": f"Bearer {token}"}) as resp:
        return await resp.text()
