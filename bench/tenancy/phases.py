"""The tricks that run beside the load rather than as one request of a worker:

* **session bursts** (``runs``: a key whose every run has ``max_steps: 3`` and a small ``max_usd``): N steps sent at
  once to a fresh run id, every few seconds, one burst of few tokens (``max_steps`` bites) then one of many
  (``max_usd`` bites first). Held: at most ``max_steps`` admitted, every other step a 429
  ``session_budget_exceeded``, the run's record says the steps admitted and at most ``max_usd`` plus one step's
  estimate (docs/sessions.md, "What a budget can miss"), and the next step after the burst is refused too;
* **the pinned run** (``pinned``: a key pinned to one run with the same budgets): one burst at the start, each step
  naming a session of its own to slip the pin; the same checks on the one run, then, every few seconds, a step and a
  passthrough request, both refused with the run's 429 for the rest of the soak;
* **the dropped tier** (``tiered``: a ``tiers: [standard]`` key): legacy completions through the passthrough with
  ``service_tier: priority``, which the standard upstream sells at twice the price. Held: each is served with
  ``x-tiergate-service-tier-dropped: key_tier`` and not at priority, and the key is charged at the default tier's
  prices what the answers' usage says (read at the end, :func:`tier_charged`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from typing import Any

import aiohttp

from bench.tenancy.common import (
    MAX_STEPS,
    MAX_USD,
    PINNED_RUN,
    PRICE,
    PRIORITY,
    STEPS_BODY,
    USD_BODY,
    Client,
    Tally,
    error_code,
    estimate,
)

BURST = 30  # steps sent at once
BURSTS = 12  # at most, for the `runs` key
BURST_EVERY = 12.0  # seconds between its bursts' starts
TIER_REQUESTS = 2000  # at most
TIER_EVERY = 0.25  # seconds between them
PINNED_CHECKS = 200  # at most
KINDS = {"steps": (STEPS_BODY, 2), "usd": (USD_BODY, 1000)}


def _param(raw: bytes) -> str:
    """The ``error.param`` of an error body (the budget a session refusal names), else ''."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return ""
    return str(err.get("param") or "") if isinstance(err, dict) else ""


class Phases(Client):
    """The side tricks of one run (module docstring), each until ``deadline`` (loop time)."""

    def __init__(self, base: str, keys: dict[str, str], seed: int, tally: Tally, deadline: float) -> None:
        super().__init__(base, keys, seed, tally)
        self.deadline = deadline

    async def _burst(self, s: aiohttp.ClientSession, name: str, run: str, kind: str, escape: bool) -> dict[str, Any]:
        """:data:`BURST` steps at once to run ``run`` (with ``escape``, each naming a run of its own: a pinned key's
        steps are its one run's whatever they name), then the run's record and one more step, checked."""
        body, max_tokens = KINDS[kind]

        async def step(i: int) -> tuple[int, bytes]:
            sid = f"{run}-escape-{i}" if escape else run
            async with s.post(self.base + "/v1/chat/completions", data=body, headers={
                    **self._h(name), "content-type": "application/json", "x-tiergate-session": sid}) as resp:
                return resp.status, await resp.read()

        answers = await asyncio.gather(*(step(i) for i in range(BURST)))
        refused: Counter[str] = Counter()
        trick = "session_burst" if name == "runs" else "pinned_run"
        for status, raw in answers:
            label = self.tally.answer(name, status, raw, trick)
            if status != 200:
                refused[f"{label} {_param(raw)}".rstrip()] += 1
        admitted = sum(1 for status, _ in answers if status == 200)
        view = await self._view(s, name, PINNED_RUN if escape else run, admitted)
        after_status, after_raw = await step(BURST)
        after = self.tally.answer(name, after_status, after_raw, trick)
        bound = MAX_USD + estimate(body, max_tokens)
        ok_refusals = all(k.startswith("429 session_budget_exceeded") for k in refused)
        held = (admitted <= MAX_STEPS and ok_refusals and view.get("steps") == admitted
                and float(view.get("cost_usd", 1e9)) <= bound and after.startswith("429 session_budget_exceeded"))
        return {"key": name, "run": run, "kind": kind, "admitted": admitted, "refused": dict(refused),
                "run_steps": view.get("steps"), "run_usd": view.get("cost_usd"), "bound_usd": round(bound, 6),
                "next_step": after, "held": held}

    async def _view(self, s: aiohttp.ClientSession, name: str, run: str, steps: int) -> dict[str, Any]:
        """The run's record (``GET /v1/tiergate/sessions/{id}``) once it holds ``steps`` (a step's end reaches it a
        moment after its answer), or as it is 5 s on."""
        start, view = time.monotonic(), dict[str, Any]()
        while time.monotonic() - start < 5:
            async with s.get(f"{self.base}/v1/tiergate/sessions/{run}", headers=self._h(name)) as resp:
                view = await resp.json() if resp.status == 200 else {"status": resp.status}
            if view.get("steps") == steps:
                break
            await asyncio.sleep(0.1)
        return view

    async def session_bursts(self) -> None:
        """The ``runs`` key's bursts, kinds in turn, each to a fresh run."""
        conn = aiohttp.TCPConnector(limit=BURST + 8)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:
            for i in range(BURSTS):
                started = time.monotonic()
                if self.deadline - started < 3:
                    return
                kind = ("steps", "usd")[i % 2]
                row = await self._burst(s, "runs", f"soak-run-{i}-{os.urandom(4).hex()}", kind, escape=False)
                self._record("session_burst", row)
                await asyncio.sleep(max(0.0, min(BURST_EVERY - (time.monotonic() - started),
                                                 self.deadline - time.monotonic())))

    async def pinned_run(self) -> None:
        """The ``pinned`` key's one burst, then its refused step and passthrough request every 5 s."""
        conn = aiohttp.TCPConnector(limit=BURST + 8)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:
            await asyncio.sleep(2.0)  # into the load
            self._record("pinned_run", await self._burst(s, "pinned", PINNED_RUN, "usd", escape=True))
            for _ in range(PINNED_CHECKS):
                await asyncio.sleep(min(5.0, max(0.0, self.deadline - time.monotonic())))
                if time.monotonic() >= self.deadline:
                    return
                status, raw = await self._post(s, "pinned", "/v1/chat/completions", STEPS_BODY)
                async with s.get(self.base + "/v1/files", headers=self._h("pinned")) as resp:
                    listed = resp.status, await resp.read()
                for got in ((status, raw), listed):
                    label = self.tally.answer("pinned", *got, "pinned_run")
                    if not label.startswith("429 session_budget_exceeded"):
                        self.tally.miss("pinned:pinned_run", f"after the run was spent: {label} {got[1][:200]!r}")

    def _record(self, trick: str, row: dict[str, Any]) -> None:
        self.tally.phases[trick].append(row)
        if not row["held"]:
            self.tally.miss(f"{row['key']}:{trick}", repr(row))

    async def tier_drop(self) -> None:
        """The ``tiered`` key's priority asks on the passthrough, one every :data:`TIER_EVERY` s."""
        body = {"model": "gpt-5.6", "prompt": "[[emulate tokens=20]] hi", "max_tokens": 20, "service_tier": "priority"}
        rows = self.tally.phases["tier_drop"]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            for _ in range(TIER_REQUESTS):
                if time.monotonic() >= self.deadline:
                    return
                async with s.post(self.base + "/v1/completions", json=body, headers=self._h("tiered")) as resp:
                    status, raw, dropped = resp.status, await resp.read(), resp.headers.get(
                        "x-tiergate-service-tier-dropped")
                self.tally.answer("tiered", status, raw, "tier_drop")
                answer = json.loads(raw) if status == 200 else {}
                usage = answer.get("usage") or {}
                p, c = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
                rows.append({"status": status, "dropped": dropped, "served": answer.get("service_tier"),
                             "default_usd": (p * PRICE["input"] + c * PRICE["output"]) / 1e6,
                             "priority_usd": (p * PRIORITY["input"] + c * PRIORITY["output"]) / 1e6})
                if status != 200 or dropped != "key_tier" or answer.get("service_tier") == "priority":
                    self.tally.miss("tiered:tier_drop", f"{status} dropped={dropped} {error_code(raw)} {raw[:200]!r}")
                await asyncio.sleep(TIER_EVERY)


def tier_charged(rows: list[dict[str, Any]], charged: float) -> dict[str, Any]:
    """The dropped tier's bill: what the key was charged against its answers' usage at the default tier's prices
    (held: the same, to rounding) and at priority's."""
    default = sum(r["default_usd"] for r in rows)
    priority = sum(r["priority_usd"] for r in rows)
    held = bool(rows) and abs(charged - default) <= 1e-9 * len(rows) + 1e-9
    return {"requests": len(rows), "dropped_header": sum(1 for r in rows if r["dropped"] == "key_tier"),
            "served_priority": sum(1 for r in rows if r["served"] == "priority"), "charged_usd": round(charged, 9),
            "at_default_usd": round(default, 9), "at_priority_usd": round(priority, 9), "held": held}
